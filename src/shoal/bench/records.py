"""What one request did, as the client saw it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome. `*_s` are seconds since the run started, `*_ms` latencies. It failed
    iff `error` is set; then what it did not reach is None (`start_s` too when it was never sent:
    a turn whose previous turn failed). `ttft_ms` is the wait for the first content chunk, `itl_ms`
    the gap before each later content chunk, `e2e_ms` the whole request. `completion_tokens` comes
    from the server's usage, or is the number of content chunks when the server sent none; `status`
    is the HTTP status, None when no response came."""

    index: int
    conversation_id: int
    turn: int
    arrival_s: float
    start_s: float | None
    ttft_ms: float | None
    itl_ms: tuple[float, ...]
    e2e_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int
    status: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def max_itl_ms(self) -> float | None:
        return max(self.itl_ms, default=None)

    def as_dict(self) -> dict:
        return {**asdict(self), "itl_ms": list(self.itl_ms)}
