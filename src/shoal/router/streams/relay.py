"""Relays one worker's server-sent events to the client, keeping what a migration needs (token
ids, seed, text received) and telling a busy worker from a hung one.

A stream is complete only when a finish reason came before `[DONE]`: a server that ends a stream
early with a bare `[DONE]` (llama-cpp-python when a new request interrupts it) has broken it. Every
event relayed is contact with its worker, so a server whose polls wait while it generates (llama-cpp-
python's lock) is not taken as down while its stream flows.

A worker is taken as hung when it sends nothing (no token, no keep-alive) for its token deadline:
clamp(token_deadline_factor × expected, min, max), where `expected` is the larger of its expected
inter-token latency and the step time it last stated in a keep-alive (before the first token:
token_deadline_max_s). A keep-alive resets the deadline, unless it says the engine has been busy
past the deadline of the step it is on (step_deadline): an engine stuck in a step still has a live
HTTP server. Keep-alives reach the client as bare SSE comments.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shoal.protocol.keep_alive import BARE, CLIENT_INTERVAL_S, parse_keep_alive
from shoal.protocol.kv_handoff import Handoff, handoff_of
from shoal.protocol.sse import DONE, data_event, data_of, is_done, json_data
from shoal.router.config import FailoverSettings
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.streams.upstream_client import UpstreamError, UpstreamResponse


class StreamBroken(Exception):
    """The worker stopped streaming before `[DONE]`: `connection_lost` when its connection broke,
    `timed_out` when it looked hung, neither when it failed the request (an error event)."""

    def __init__(self, message: str, connection_lost: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.connection_lost = connection_lost
        self.timed_out = timed_out


class HandedOff(Exception):
    """The worker handed the stream off (shoal.protocol.kv_handoff): it goes on elsewhere."""

    def __init__(self, handoff: Handoff):
        super().__init__(f"handed off ({handoff.reason})")
        self.handoff = handoff


@dataclass
class StreamProgress:
    """What the client has received so far. Invariant: token_ids are exactly the tokens relayed,
    where the worker sends their ids (`tokens` counts them, or the chunks with output where it
    does not); `opened` once an opening (role) chunk was relayed, and only then; text_chars counts
    the raw output text relayed (a chunk read for tool calls or reasoning states it in
    `text_chars`, else it is the chunk's text); `output` holds the pieces of output text relayed
    (`text` joins them), and `tool_calls` and `reasoning` say whether tool call or reasoning deltas
    were relayed too (their text is not in `output`); `finished` once a finish reason (or the
    request's own error) was relayed."""

    token_ids: list[int] = field(default_factory=list)
    opened: bool = False
    text_chars: int = 0
    seed: int | None = None
    response_id: str | None = None
    migrations: int = 0
    handoffs: int = 0
    output: list[str] = field(default_factory=list)
    tokens: int = 0
    tool_calls: bool = False
    reasoning: bool = False
    finished: bool = False

    @property
    def text(self) -> str:
        return "".join(self.output)

    def event_id(self) -> str:
        """Where the client stands after the event just relayed (shoal.router.streams.journal)."""
        return f"{self.response_id}:{len(self.token_ids)}:{self.text_chars}"

    def resume_body(self, body: dict) -> dict:
        return {
            **body,
            "resume_token_ids": list(self.token_ids),
            "resume_text_offset": self.text_chars,
            "seed": self.seed if self.seed is not None else body.get("seed"),
        }


def is_client_error(event: dict) -> bool:
    """An error event whose code is a 4xx status: the request is wrong (say, its grammar allows no
    token of the model's vocabulary), not the worker."""
    code = (event.get("error") or {}).get("code")
    return isinstance(code, int) and 400 <= code < 500


def token_deadline(settings: FailoverSettings, expected_s: float | None) -> float:
    """Seconds of silence after which a worker is taken as hung."""
    if expected_s is None:
        return settings.token_deadline_max_s
    return min(
        max(settings.token_deadline_factor * expected_s, settings.token_deadline_min_s), settings.token_deadline_max_s
    )


def step_deadline(settings: FailoverSettings, step_s: float | None) -> float:
    """Seconds one engine step may run before its worker is taken as hung: token_deadline_factor ×
    the step's stated time, at least token_deadline_min_s, and not capped (a worker that expects
    a long step may take it); token_deadline_max_s for a step of unknown length."""
    if step_s is None:
        return settings.token_deadline_max_s
    return max(settings.token_deadline_factor * step_s, settings.token_deadline_min_s)


async def relay(
    upstream: UpstreamResponse,
    worker: WorkerState,
    progress: StreamProgress,
    telemetry: RequestTelemetry,
    settings: FailoverSettings,
    ticket: int,
    event_ids: bool = False,
) -> AsyncIterator[bytes]:
    """Yields the worker's events, and a bare keep-alive when the client has been sent nothing for
    CLIENT_INTERVAL_S, updating progress, the worker's latency figures and, at the first token, what
    it serves at once (the request's `ticket`); raises StreamBroken if it stops short, HandedOff at a
    handoff event. Events that arrived together are read one by one and yielded as one chunk (one
    write to the client, not one each); invariant: whenever the relay waits for the worker, or
    raises, everything `progress` counts has been yielded. With `event_ids` each event gets an SSE
    `id:` and the same id as `event_id` in its JSON (for clients that do not show SSE ids)."""
    resumed = progress.response_id is not None  # a migration or a resumed stream: one response id
    last = client_heard = time.monotonic()  # the last token; the last thing the client was sent
    first = True
    stated_step_s: float | None = None  # the step time the worker last stated, since its last token
    deadline = token_deadline(settings, None)
    pending: list[bytes] = []  # events read but not yet yielded, from what arrived together

    def next_deadline() -> float:
        if first:
            return token_deadline(settings, stated_step_s)
        return token_deadline(settings, max((s for s in (worker.expected_itl_s(), stated_step_s) if s), default=None))

    try:
        while True:
            if pending and not upstream.line_ready():
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending.clear()
            try:
                line = await upstream.readline(deadline)
            except TimeoutError:
                raise StreamBroken(f"no event within {deadline:.1f} s", timed_out=True) from None
            except UpstreamError as exc:
                raise StreamBroken(type(exc).__name__, connection_lost=True) from None
            if not line:
                raise StreamBroken("the stream ended without [DONE]", connection_lost=True)
            if line.isspace():
                continue  # the blank line that ends each event
            keep_alive = parse_keep_alive(line)
            if keep_alive is not None:
                stated_step_s = keep_alive.step_s or stated_step_s
                limit = step_deadline(settings, keep_alive.step_s)
                if keep_alive.busy_s is not None and keep_alive.busy_s > limit:
                    raise StreamBroken(
                        f"the engine has been on one step for {keep_alive.busy_s:.1f} s, expected "
                        f"{keep_alive.step_s or 'unknown'} s (limit {limit:.1f} s)",
                        timed_out=True,
                    )
                deadline = next_deadline()
                if time.monotonic() - client_heard >= CLIENT_INTERVAL_S:
                    client_heard = time.monotonic()
                    pending.append(BARE)
                continue
            payload = data_of(line)
            if payload is None:
                continue
            if is_done(payload):
                if not progress.finished:  # a server that cut the stream short (llama-cpp-python does when interrupted)
                    raise StreamBroken("the stream ended without a finish reason", connection_lost=True)
                pending.append(DONE)
                yield b"".join(pending)
                return
            now = client_heard = time.monotonic()
            worker.last_seen = now  # events flowing are contact, whether or not polls answer
            try:
                event = json_data(payload)
            except ValueError:
                raise StreamBroken("the worker sent an event that is not a JSON object") from None
            if "error" in event:
                if is_client_error(event):  # the request's own fault: any worker would say the same
                    progress.finished = True
                    pending.append(data_event(payload))
                    continue
                raise StreamBroken(f"the worker failed the request: {event['error'].get('message')}")
            try:
                handoff = handoff_of(event)
            except ValueError as exc:
                raise StreamBroken(str(exc)) from None
            if handoff is not None:
                raise HandedOff(handoff)
            choice = (event.get("choices") or [{}])[0]
            delta = choice.get("delta") or {}
            token_ids = choice.get("token_ids") or []
            text = choice.get("text") or delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            tokens = len(token_ids) or (1 if text or reasoning or delta.get("tool_calls") else 0)
            if tokens:
                if first:
                    worker.first_token(ticket)
                else:
                    worker.latency.observe_itl((now - last) / tokens)
                last, first, stated_step_s = now, False, None
                deadline = next_deadline()
                telemetry.tokens(tokens)
            opening = "role" in delta and not tokens and not choice.get("finish_reason")
            if opening and progress.opened:
                continue  # a continuation's opening role chunk: the client has one already
            progress.opened = progress.opened or opening
            progress.token_ids += token_ids
            progress.tokens += tokens
            if text:
                progress.output.append(text)
            progress.tool_calls = progress.tool_calls or bool(delta.get("tool_calls"))
            progress.reasoning = progress.reasoning or bool(reasoning)
            progress.finished = progress.finished or bool(choice.get("finish_reason"))
            progress.seed = choice.get("seed", progress.seed)
            progress.text_chars += choice.get("text_chars", len(text))
            if progress.response_id is None:
                progress.response_id = event.get("id")
            if resumed:
                event["id"] = progress.response_id
            if event_ids:
                event["event_id"] = progress.event_id()
                pending.append(b"id: " + event["event_id"].encode() + b"\n" + data_event(event))
            else:
                pending.append(data_event(json.dumps(event).encode() if resumed else payload))
    except (StreamBroken, HandedOff):
        if pending:  # what progress counts reaches the client before the stream moves
            yield b"".join(pending)
        raise
