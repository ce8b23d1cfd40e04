"""One streamed chat completion against an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from shoal.bench.records import RequestRecord
from shoal.bench.workloads import BenchRequest, Message
from shoal.protocol.sse import data_of, is_done, json_data

ERROR_TEXT_CHARS = 500


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def base_url(url: str) -> str:
    """The server's root: `http://host:8000/v1/` and `http://host:8000` both give `http://host:8000`."""
    return url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class ClientSettings:
    """How requests are sent: to `url` (a server root), greedy unless `temperature` > 0, each with
    `timeout_s` to finish. `api_key` goes out as a bearer token and is never reported."""

    url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0

    def as_dict(self) -> dict:
        return {
            "url": self.url,
            "model": self.model,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "timeout_s": self.timeout_s,
        }


async def first_model(session: aiohttp.ClientSession, url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models; raises whatever kept it from naming one."""
    async with session.get(
        base_url(url) + "/v1/models", headers=auth_headers(api_key), timeout=aiohttp.ClientTimeout(total=30)
    ) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError("the server lists no models")
    return models[0]["id"]


class ChatClient:
    """Sends streamed chat completions (`stream_options.include_usage` on) through one session.
    `send` never raises for a failed request: the failure is in its record."""

    def __init__(self, session: aiohttp.ClientSession, settings: ClientSettings) -> None:
        self.session = session
        self.settings = settings
        self.endpoint = base_url(settings.url) + "/v1/chat/completions"

    async def send(self, request: BenchRequest, messages: list[Message], run_start: float) -> tuple[RequestRecord, str]:
        """Sends `messages` (the request's, answers filled in) and returns its record and the answer
        text; `run_start` is the run's time.perf_counter() origin."""
        body = {
            "model": self.settings.model,
            "messages": messages,
            "max_tokens": request.max_tokens,
            "temperature": self.settings.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.settings.ignore_eos:
            body["ignore_eos"] = True
        stream = _Stream()
        start = time.perf_counter()
        try:
            async with self.session.post(
                self.endpoint,
                json=body,
                headers=auth_headers(self.settings.api_key),
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
            ) as response:
                stream.status = response.status
                if response.status != 200:
                    stream.error = _error_text(await response.text()) or response.reason or "no body"
                else:
                    await stream.read(response.content)
        except Exception as exc:  # any failure of this request belongs in its record, not the run's
            stream.error = f"{type(exc).__name__}: {exc}".removesuffix(": ")
        end = time.perf_counter()
        return stream.record(request, run_start, start, end), "".join(stream.text)


@dataclass
class _Stream:
    """What has come back of one response so far."""

    status: int | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict | None = None

    async def read(self, content: aiohttp.StreamReader) -> None:
        """Reads SSE events up to `data: [DONE]`; an error event, or an end without [DONE], is an error."""
        async for line in content:
            data = data_of(line)
            if data is None:
                continue
            if is_done(data):
                return
            event = json_data(data)
            if "error" in event:
                self.error = _error_text(data.decode("utf-8", "replace"))
                return
            self.usage = event.get("usage") or self.usage
            pieces = [(choice.get("delta") or {}).get("content") for choice in event.get("choices") or []]
            if any(pieces):
                self.chunk_times.append(time.perf_counter())
                self.text.extend(p for p in pieces if p)
        self.error = "the stream ended before [DONE]"

    def record(self, request: BenchRequest, run_start: float, start: float, end: float) -> RequestRecord:
        times = self.chunk_times
        return RequestRecord(
            index=request.index,
            conversation_id=request.conversation_id,
            turn=request.turn,
            arrival_s=request.arrival_s,
            start_s=start - run_start,
            ttft_ms=(times[0] - start) * 1000 if times else None,
            itl_ms=tuple((b - a) * 1000 for a, b in zip(times, times[1:])),
            e2e_ms=(end - start) * 1000 if self.error is None else None,
            prompt_tokens=self.usage.get("prompt_tokens") if self.usage else None,
            completion_tokens=self.usage.get("completion_tokens", 0) if self.usage else len(times),
            status=self.status,
            error=self.error,
        )


def _error_text(body: str) -> str:
    """An OpenAI-style error's message, else the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])[:ERROR_TEXT_CHARS]
    except (ValueError, KeyError, TypeError):
        return body.strip()[:ERROR_TEXT_CHARS]
