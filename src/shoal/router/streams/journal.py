"""Streams that outlive their router: each journaled stream's progress in Redis, so that a client
reconnecting with `Last-Event-ID` to any router sharing the store gets the rest of the same stream.

A journaled stream's every event carries an id, `RESPONSE_ID:TOKENS:CHARS` (what the client has
received with that event: token count and raw text characters). The journal holds the request as it
was sent to workers, its owner, the sampling seed and a prefix of the token ids with the text
characters at its end (the "mark"). Token ids are written in batches of `flush_tokens`, one Redis
round trip a batch, off the relay's path; so the journal may lag behind the client. A resume from a
lagging journal first regenerates the missing tokens (the same seed gives the same tokens at the same
positions) without sending them, then continues from exactly where the client stopped.

Keys: shoal:stream:{id} (hash: path, body, owner, seed, mark "K CHARS") and shoal:stream:{id}:tokens
(list of token ids, the first K of the stream), both expiring ttl_s after the last write.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import redis.asyncio as redis
from redis.exceptions import RedisError

from shoal.router.config import ResumableStreamsSettings
from shoal.router.streams.relay import StreamProgress

log = logging.getLogger(__name__)

KEY_PREFIX = "shoal:stream:"


class ResumeRefused(Exception):
    """A Last-Event-ID that cannot be resumed here: `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class EventId:
    """Where a client stands in a journaled stream."""

    response_id: str
    tokens: int
    chars: int

    @classmethod
    def parse(cls, raw: str) -> EventId:
        response_id, _, rest = raw.strip().rpartition(":")
        response_id, _, tokens = response_id.rpartition(":")
        if not response_id or not tokens.isdigit() or not rest.isdigit():
            raise ResumeRefused(400, f"Last-Event-ID {raw!r} is not an event id of a shoal stream")
        return cls(response_id, int(tokens), int(rest))


@dataclass(frozen=True)
class Journaled:
    """A journaled stream as read back: the request, and the progress its journal had reached."""

    path: str
    body: dict
    seed: int | None
    token_ids: list[int]
    text_chars: int


class StreamJournal:
    """Invariant: a stream's token list is a prefix of the tokens its client was sent, and its mark
    counts that prefix and the text it stands for."""

    def __init__(self, client: redis.Redis, settings: ResumableStreamsSettings):
        self.client = client
        self.settings = settings
        self.writes = 0  # Redis round trips made, for the cost figures

    @classmethod
    def open(cls, settings: ResumableStreamsSettings) -> StreamJournal:
        return cls(redis.from_url(settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0), settings)

    def writer(self, path: str, body: dict, owner: str) -> JournalWriter:
        return JournalWriter(self, path, body, owner)

    async def read(self, response_id: str, owner: str) -> Journaled:
        key = KEY_PREFIX + response_id
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                stored, token_ids = await pipe.hgetall(key).lrange(key + ":tokens", 0, -1).execute()
        except RedisError as exc:
            raise ResumeRefused(503, f"the stream journal is unreachable: {exc}") from exc
        if not stored or stored.get(b"owner", b"").decode() != owner:  # another key's stream is unknown
            raise ResumeRefused(404, f"no resumable stream {response_id!r} (unknown, expired or not yours)")
        marked, chars = (int(x) for x in stored.get(b"mark", b"0 0").split())
        seed = stored.get(b"seed")
        return Journaled(
            path=stored[b"path"].decode(),
            body=json.loads(stored[b"body"]),
            seed=int(seed) if seed else None,
            token_ids=[int(t) for t in token_ids[:marked]],
            text_chars=chars,
        )

    async def close(self) -> None:
        await self.client.aclose()


class JournalWriter:
    """Writes one stream's journal: the request once its response id is known, then its token ids in
    batches, each batch one pipelined round trip, at most one in flight (the next batch waits and
    grows). A store that fails is logged once per stream and the stream goes on unjournaled."""

    def __init__(self, journal: StreamJournal, path: str, body: dict, owner: str):
        self.journal, self.path, self.body, self.owner = journal, path, body, owner
        self.written = 0  # tokens in the journal, or being written
        self.begun = False
        self.failed = False
        self.pending: asyncio.Task | None = None

    def resumed_at(self, journaled_tokens: int) -> None:
        """The stream continues one whose journal holds its first `journaled_tokens` token ids."""
        self.begun, self.written = True, journaled_tokens

    def advance(self, progress: StreamProgress, final: bool = False) -> None:
        """Called after each relayed event; schedules a write when a batch is due (or at the end)."""
        if self.failed or progress.response_id is None or (self.pending and not self.pending.done()):
            return
        due = len(progress.token_ids) - self.written
        if self.begun and (due <= 0 or (due < self.journal.settings.flush_tokens and not final)):
            return
        tokens, chars = list(progress.token_ids), progress.text_chars
        self.pending = asyncio.create_task(self._write(progress.response_id, tokens, chars, progress.seed))

    async def _write(self, response_id: str, tokens: list[int], chars: int, seed: int | None) -> None:
        key, ttl = KEY_PREFIX + response_id, int(self.journal.settings.ttl_s)
        try:
            async with self.journal.client.pipeline(transaction=True) as pipe:
                if not self.begun:
                    pipe.hset(key, mapping={"path": self.path, "body": json.dumps(self.body), "owner": self.owner})
                new = tokens[self.written :]
                if new:
                    pipe.rpush(key + ":tokens", *new)
                mark = {"mark": f"{len(tokens)} {chars}", **({"seed": seed} if seed is not None else {})}
                pipe.hset(key, mapping=mark)
                pipe.expire(key, ttl).expire(key + ":tokens", ttl)
                await pipe.execute()
            self.journal.writes += 1
            self.begun, self.written = True, len(tokens)
        except RedisError as exc:
            self.failed = True
            log.warning("stream %s is no longer journaled (it cannot be resumed elsewhere): %s", response_id, exc)

    async def finish(self, progress: StreamProgress) -> None:
        """Writes what is left once the stream has ended (waiting for the write in flight first)."""
        if self.pending is not None:
            await asyncio.shield(self.pending)
        self.advance(progress, final=True)
        if self.pending is not None:
            await asyncio.shield(self.pending)
