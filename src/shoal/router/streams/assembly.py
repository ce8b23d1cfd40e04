"""One non-streamed OpenAI response from the events of a stream (the router streams from workers
even for non-streaming clients, so that a failure mid-way can be continued elsewhere)."""

from __future__ import annotations


def _merge_logprobs(parts: list[dict | None], chat: bool) -> dict | None:
    parts = [p for p in parts if p]
    if not parts:
        return None
    if chat:
        return {"content": [entry for p in parts for entry in p.get("content") or []]}
    return {
        key: [v for p in parts for v in p.get(key) or []]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }


def _add_tool_call_deltas(calls: dict[int, dict], deltas: list[dict]) -> None:
    """A call's first delta brings its id, type and name; later ones fragments of its arguments."""
    for delta in deltas:
        function = delta.get("function") or {}
        call = calls.setdefault(
            delta.get("index", 0), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        call["id"] = delta.get("id") or call["id"]
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""


def _message(part: dict) -> dict:
    content = "".join(part["text"])
    reasoning = "".join(part["reasoning"])
    shown = {"reasoning_content": reasoning} if reasoning else {}
    if part["function_call"] is not None:  # a request of legacy functions
        return {"role": "assistant", "content": content or None, **shown, "function_call": part["function_call"]}
    if not part["tool_calls"]:
        return {"role": "assistant", "content": content, **shown}
    calls = [part["tool_calls"][index] for index in sorted(part["tool_calls"])]
    return {"role": "assistant", "content": content or None, **shown, "tool_calls": calls}


def assemble(events: list[dict], chat: bool) -> dict:
    """Invariant: each choice's text, reasoning, tool calls (or legacy function call), token ids and
    logprobs are the concatenation of its deltas in order; its stop_reason the last one its events gave; usage is
    the stream's final usage; the service tier is the stream's, where it reports one."""
    first = events[0]
    parts: dict[int, dict] = {}
    usage = None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            part = parts.setdefault(
                choice.get("index", 0),
                {
                    "text": [],
                    "reasoning": [],
                    "token_ids": [],
                    "logprobs": [],
                    "finish_reason": None,
                    "seed": None,
                    "stop_reason": None,
                    "tool_calls": {},
                    "function_call": None,
                },
            )
            delta = choice.get("delta") or {}
            _add_tool_call_deltas(part["tool_calls"], delta.get("tool_calls") or [])
            if delta.get("function_call"):
                call = part["function_call"] = part["function_call"] or {"name": None, "arguments": ""}
                call["name"] = delta["function_call"].get("name") or call["name"]
                call["arguments"] += delta["function_call"].get("arguments") or ""
            part["reasoning"].append(delta.get("reasoning_content") or delta.get("reasoning") or "")
            part["token_ids"] += choice.get("token_ids") or []
            part["text"].append(delta.get("content") or "" if chat else choice.get("text") or "")
            part["logprobs"].append(choice.get("logprobs"))
            part["finish_reason"] = choice.get("finish_reason") or part["finish_reason"]
            part["seed"] = choice.get("seed", part["seed"])
            part["stop_reason"] = choice.get("stop_reason", part["stop_reason"])
    choices = []
    for index in sorted(parts):
        part = parts[index]
        choice = {
            "index": index,
            "finish_reason": part["finish_reason"],
            "stop_reason": part["stop_reason"],
            "token_ids": part["token_ids"],
            "seed": part["seed"],
            "logprobs": _merge_logprobs(part["logprobs"], chat),
        }
        if chat:
            choice["message"] = _message(part)
        else:
            choice["text"] = "".join(part["text"])
        choices.append(choice)
    tier = {"service_tier": first["service_tier"]} if "service_tier" in first else {}
    return {
        "id": first.get("id"),
        "created": first.get("created"),
        "model": first.get("model"),
        "object": "chat.completion" if chat else "text_completion",
        **tier,
        "choices": choices,
        "usage": usage,
    }
