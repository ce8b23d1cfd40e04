"""Streamed requests that carry a W3C traceparent."""

from __future__ import annotations

import httpx

from tests.support.workers import MODEL

MAX_TOKENS = 6  # what each traced request asks for


def streamed(url: str, traceparent: str) -> tuple[str, str]:
    """Streams one chat completion to the end; returns the trace and request ids the router
    answered with."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=60, headers={"traceparent": traceparent}
    ) as response:
        assert response.status_code == 200
        assert response.read().endswith(b"data: [DONE]\n\n")
        return response.headers["x-shoal-trace-id"], response.headers["x-request-id"]
