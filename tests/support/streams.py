"""Reading a streamed chat completion through a router, with a fault injected once enough tokens arrived."""

from __future__ import annotations

import json
import time

import httpx

from tests.support.workers import MODEL


def read_stream(url: str, body: dict, fault=None, after_tokens: int = 20) -> dict:
    """Streams one chat completion; calls fault(worker_url) once `after_tokens` tokens arrived.
    `seeds` are the sampling seeds its chunks name (the one drawn by the worker when none was given);
    `reasoning` what its reasoning_content deltas add up to; `tool_calls` the calls its deltas add
    up to, and `finish_reason` the last one given; `longest_gap_s` the longest wait between two
    chunks with tokens."""
    ids, text, reasoning, response_ids, seeds, usage, roles = [], [], [], set(), set(), None, 0
    last_token_at, longest_gap_s = None, 0.0
    tool_calls: dict[int, dict] = {}
    finish_reason = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        worker, trace_id = response.headers["x-shoal-worker"], response.headers["x-shoal-trace-id"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            response_ids.add(event["id"])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                if choice.get("token_ids"):
                    now = time.monotonic()
                    longest_gap_s = max(longest_gap_s, now - (last_token_at or now))
                    last_token_at = now
                if choice.get("token_ids"):
                    seeds.add(choice.get("seed"))
                roles += "role" in choice.get("delta", {})
                text.append(choice.get("delta", {}).get("content") or "")
                reasoning.append(choice.get("delta", {}).get("reasoning_content") or "")
                finish_reason = choice.get("finish_reason") or finish_reason
                for delta in choice.get("delta", {}).get("tool_calls") or []:
                    call = tool_calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
                    call["id"] = delta.get("id") or call["id"]
                    call["name"] = delta.get("function", {}).get("name") or call["name"]
                    call["arguments"] += delta.get("function", {}).get("arguments") or ""
            if fault and len(ids) >= after_tokens:
                fault(worker)
                fault = None
    return {
        "ids": ids,
        "text": "".join(text),
        "reasoning": "".join(reasoning),
        "response_ids": response_ids,
        "seeds": seeds,
        "usage": usage,
        "roles": roles,
        "worker": worker,
        "trace_id": trace_id,
        "tool_calls": [tool_calls[index] for index in sorted(tool_calls)],
        "finish_reason": finish_reason,
        "longest_gap_s": longest_gap_s,
    }


def story_request(seed: int, max_tokens: int) -> dict:
    """A seeded, streamed chat request for `max_tokens` tokens (EOS ignored), with usage."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_chunks(url: str, body: dict) -> tuple[list[dict], dict]:
    """The choice of each chunk of a streamed chat completion, and its usage."""
    choices, usage = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                choices += event["choices"]
    return choices, usage
