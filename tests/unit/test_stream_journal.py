"""The stream journal against a real redis-server: event ids, batched writes that keep the journal a
prefix of what the client was sent, and reads that only the stream's owner may make."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shoal.router.config import ResumableStreamsSettings
from shoal.router.streams.journal import EventId, ResumeRefused, StreamJournal
from shoal.router.streams.relay import StreamProgress


def test_an_event_id_names_the_response_the_tokens_and_the_characters_received():
    progress = StreamProgress(token_ids=[5, 6, 7], text_chars=11, response_id="chatcmpl-abc")
    assert progress.event_id() == "chatcmpl-abc:3:11"
    assert EventId.parse(progress.event_id()) == EventId("chatcmpl-abc", 3, 11)
    for malformed in ("chatcmpl-abc", "chatcmpl-abc:3", ":3:11", "x:three:11", "x:3:-1"):
        with pytest.raises(ResumeRefused) as refused:
            EventId.parse(malformed)
        assert refused.value.status == 400


def test_token_ids_are_written_in_batches_and_the_journal_stays_a_prefix_of_the_stream(redis_url):
    async def scenario():
        journal = StreamJournal.open(ResumableStreamsSettings(store="redis", redis_url=redis_url, flush_tokens=4))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        writer = journal.writer("/v1/chat/completions", body, "alice")
        progress = StreamProgress(seed=9, response_id=f"chatcmpl-{uuid.uuid4().hex}")
        marks = []
        for token in range(10):
            progress.token_ids.append(100 + token)
            progress.text_chars += 2
            writer.advance(progress)
            if writer.pending is not None:
                await writer.pending  # let the write in flight land
            read = await journal.read(progress.response_id, "alice")
            assert read.token_ids == progress.token_ids[: len(read.token_ids)]
            marks.append(len(read.token_ids))
            assert read.text_chars == 2 * len(read.token_ids)
        await writer.finish(progress)
        read = await journal.read(progress.response_id, "alice")
        assert (read.token_ids, read.text_chars, read.seed, read.body) == (progress.token_ids, 20, 9, body)
        assert marks == sorted(marks) and marks[-1] < 10  # the journal lags by less than a batch
        assert journal.writes <= 1 + 10 // 4 + 1
        with pytest.raises(ResumeRefused) as refused:
            await journal.read(progress.response_id, "mallory")
        assert refused.value.status == 404
        await journal.close()

    asyncio.run(scenario())
