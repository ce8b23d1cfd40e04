"""Background responses (`background: true`): the request returns the response queued, and a
router generates it afterwards. GET /v1/responses/{id} polls it; with `stream=true` (and
`starting_after`, a sequence number) it streams its events from there on, live until the end;
POST /v1/responses/{id}/cancel stops it. A cancelled response keeps the text its message had so far.

A background response lives in the state store: its stored turn (status queued, in_progress, then
final), the chat request that produces it (with a sampling seed fixed at creation), and each of its
events as it is made. One router generates it at a time, under a lease (state.leased_work). When
that router dies, another takes it over and generates it again from the start: with the same seed
and batch-invariant kernels the same tokens come, and its items keep their ids (responses_api.ids
derives them from the response id), so the events already stored are made again identically and
only the ones after them are stored; a client streaming it reads one unbroken sequence."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.protocol.sse import named_event
from shoal.router.admission.auth import ApiKeys, Client
from shoal.router.front_door import FrontDoor
from shoal.router.placement.route_request import CHAT_PATH
from shoal.router.responses_api.event_stream import response_events
from shoal.router.responses_api.ids import ItemIds
from shoal.router.responses_api.message_items import output_message, output_text_part
from shoal.router.responses_api.response_object import failed_response
from shoal.router.responses_api.stored_turn import KIND as TURN_KIND
from shoal.router.responses_api.stored_turn import StoredTurn
from shoal.router.state.leased_work import mark_active, mark_finished
from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import Record, RecordStore, every_record

log = logging.getLogger(__name__)

KIND = "background_response"  # the work (and its lease): id the response id, owner its client
EVENT_KIND = "response_event"  # id RESPONSE_ID:SEQUENCE, owner the response id, created_at the sequence number
CANCEL_KIND = "response_cancel"  # id the response id: its presence asks the response's router to stop
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
POLL_S = 0.1  # how often a streaming reader looks for new events
CANCEL_CHECK_S = 0.5  # how often a generating router looks for a cancel
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the generating router to stop
MAX_SEED = 2**31


def _event_id(response_id: str, sequence: int) -> str:
    return f"{response_id}:{sequence:08d}"


def _event_type(event: bytes | str) -> str:
    text = event.decode() if isinstance(event, bytes) else event
    return text.partition("\n")[0].removeprefix("event: ")


class BackgroundResponses:
    """Invariants: a background response's events are stored in sequence order without gaps, each
    once; its stored turn is final (completed, incomplete, failed, cancelled) before its work is
    marked finished; only the router holding its lease writes its turn and events after creation."""

    def __init__(self, front_door: FrontDoor, records: SharedRecords, api_keys: ApiKeys):
        self.front_door = front_door
        self.records = records
        self.api_keys = api_keys

    @property
    def store(self) -> RecordStore:
        return self.records.store

    async def start(
        self, chat_body: dict, skeleton: dict, message_id: str, session: str, input_items: list[dict], client: Client
    ) -> dict:
        """Stores a new background response and offers it to the routers; returns it queued."""
        seed = chat_body.get("seed") if isinstance(chat_body.get("seed"), int) else secrets.randbelow(MAX_SEED)
        body = {**chat_body, "stream": True, "stream_options": {"include_usage": True}, "seed": seed}
        queued = {**skeleton, "status": "queued"}
        now = time.time()
        work = {"chat_body": body, "message_id": message_id, "session": session, "skeleton": skeleton}
        await self.store.put(StoredTurn(queued, input_items, client.name).record())
        await self.store.put(Record(KIND, skeleton["id"], client.name, now, work))
        await mark_active(self.store, KIND, skeleton["id"], now)
        return queued

    def streamed(self, response_id: str, starting_after: int, headers: dict[str, str] | None = None) -> Response:
        return StreamingResponse(
            self.events(response_id, starting_after), media_type="text/event-stream", headers=headers
        )

    async def events(self, response_id: str, starting_after: int = -1) -> AsyncIterator[bytes]:
        """The response's events after `starting_after`, as they are stored, up to its final one
        (or, for a cancelled response, the last one stored)."""
        after = None
        while True:
            turn = await self.store.get(TURN_KIND, response_id)
            page = await self.store.page(
                EVENT_KIND, response_id, after, 100, match=lambda record: record.created_at > starting_after
            )
            for record in page.records:
                after = record.id
                yield record.body["event"].encode()
                if _event_type(record.body["event"]) in FINAL_EVENTS:
                    return
            if page.records:
                continue
            if turn is None or turn.body["response"]["status"] in TERMINAL:  # nothing more will be stored
                return
            await asyncio.sleep(POLL_S)

    async def cancel(self, turn: StoredTurn) -> Response:
        """Asks the response's router to stop, and answers the response once it has (or as it then stands)."""
        response_id = turn.response_id
        existing = await self.store.get(CANCEL_KIND, response_id)
        if existing is None:
            await self.store.put(Record(CANCEL_KIND, response_id, turn.owner, time.time(), {}))
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            record = await self.store.get(TURN_KIND, response_id)
            if record is not None and record.body["response"]["status"] in TERMINAL:
                return JSONResponse(record.body["response"])
            await asyncio.sleep(POLL_S)
        return JSONResponse(turn.response)

    async def forget(self, response_id: str) -> None:
        """Deletes what a deleted response left besides its turn: its events and cancel request."""
        for record in [record async for record in every_record(self.store, EVENT_KIND, response_id)]:
            await self.store.delete(EVENT_KIND, record.id)
        await self.store.delete(CANCEL_KIND, response_id)

    async def run_response(self, response_id: str) -> None:
        """Generates one background response to its end (LeasedWork calls it under the lease)."""
        work, turn_record = await self.store.get(KIND, response_id), await self.store.get(TURN_KIND, response_id)
        if work is None or turn_record is None or turn_record.body["response"]["status"] in TERMINAL:
            await self._finished(response_id)
            return
        turn = StoredTurn.from_record(turn_record)
        stored = await self._stored_events(response_id)
        if await self.store.get(CANCEL_KIND, response_id) is not None:
            await self._end(turn, _cancelled(work.body, ""))
            return
        client = self.api_keys.named(work.owner)
        if client is None:
            await self._fail(turn, stored, f"the API key {work.owner!r} that created it is no longer valid")
            return
        answer = await self.front_door.dispatch(
            work.body["chat_body"], {"x-shoal-session": work.body["session"]}, CHAT_PATH, True, client
        )
        if answer.status_code != 200 or not isinstance(answer, StreamingResponse):
            await self._fail(turn, stored, _error_message(answer))
            return

        async def keep(response: dict) -> None:
            await self.store.put(StoredTurn(response, turn.input_items, turn.owner).record())

        events = response_events(
            answer.body_iterator,
            work.body["skeleton"],
            work.body["message_id"],
            keep,
            bool(work.body["chat_body"].get("logprobs")),
            ItemIds(response_id),
        )
        sequence, checked, last, text = 0, time.monotonic(), b"", []
        try:
            async for event in events:
                if sequence >= stored:
                    await self._store_event(response_id, sequence, event)
                if sequence == 1 and turn.response["status"] == "queued":
                    await self.store.put(StoredTurn(work.body["skeleton"], turn.input_items, turn.owner).record())
                if _event_type(event) == "response.output_text.delta":
                    text.append(json.loads(event.partition(b"data: ")[2])["delta"])
                sequence, last = sequence + 1, event
                if time.monotonic() - checked > CANCEL_CHECK_S:
                    checked = time.monotonic()
                    if await self.store.get(CANCEL_KIND, response_id) is not None:
                        await events.aclose()
                        await self._end(turn, _cancelled(work.body, "".join(text)))
                        return
        finally:
            await events.aclose()
        if _event_type(last) == "response.failed":
            failed = json.loads(last.partition(b"data: ")[2])["response"]
            await self.store.put(StoredTurn(failed, turn.input_items, turn.owner).record())
        await self._finished(response_id)

    async def _stored_events(self, response_id: str) -> int:
        return sum([1 async for _ in every_record(self.store, EVENT_KIND, response_id)])

    async def _store_event(self, response_id: str, sequence: int, event: bytes) -> None:
        record = Record(EVENT_KIND, _event_id(response_id, sequence), response_id, sequence, {"event": event.decode()})
        await self.store.put(record)

    async def _fail(self, turn: StoredTurn, stored: int, message: str) -> None:
        """Ends the response failed, its stream with an error and response.failed event."""
        failed = failed_response({**turn.response, "status": "in_progress"}, message)
        error = {"type": "error", "code": "server_error", "message": message, "param": None}
        for offset, (kind, payload) in enumerate((("error", error), ("response.failed", {"response": failed}))):
            payload = {**payload, "type": kind, "sequence_number": stored + offset}
            await self._store_event(turn.response_id, stored + offset, named_event(kind, payload))
        await self._end(turn, failed)

    async def _end(self, turn: StoredTurn, response: dict) -> None:
        await self.store.put(StoredTurn(response, turn.input_items, turn.owner).record())
        await self._finished(turn.response_id)

    async def _finished(self, response_id: str) -> None:
        await self.store.delete(KIND, response_id)
        await mark_finished(self.store, KIND, response_id)
        log.info("background response %s finished", response_id)


def _cancelled(work: dict, text: str) -> dict:
    """The response as its cancel left it: the message's text so far (a reasoning or a tool call in
    progress is not kept)."""
    content = [output_text_part(text)] if text else []
    output = [output_message(work["message_id"], "incomplete", content)] if content else []
    return {**work["skeleton"], "status": "cancelled", "output": output}


def _error_message(answer: Response) -> str:
    try:
        return json.loads(answer.body)["error"]["message"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"the response could not be generated (status {answer.status_code})"
