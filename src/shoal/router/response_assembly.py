"""One non-streamed OpenAI response from the events of a stream (the router streams from workers
even for non-streaming clients, so that a failure mid-way can be continued elsewhere)."""
from __future__ import annotations


def _merge_logprobs(parts: list[dict | None], chat: bool) -> dict | None:
    parts = [p for p in parts if p]
    if not parts:
        return None
    if chat:
        return {"content": [entry for p in parts for entry in p.get("content") or []]}
    return {key: [v for p in parts for v in p.get(key) or []] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                         "text_offset")}


def assemble(events: list[dict], chat: bool) -> dict:
    """Invariant: text, token ids and logprobs are the concatenation of the events' deltas in order;
    usage is the stream's final usage. Only choice 0 is assembled (failover streams have n = 1)."""
    first = events[0]
    text, token_ids, logprobs = [], [], []
    finish_reason, seed, usage = None, None, None
    for event in events:
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            token_ids += choice.get("token_ids") or []
            text.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or "")
            logprobs.append(choice.get("logprobs"))
            finish_reason = choice.get("finish_reason") or finish_reason
            seed = choice.get("seed", seed)
    choice = {"index": 0, "finish_reason": finish_reason, "token_ids": token_ids, "seed": seed,
              "logprobs": _merge_logprobs(logprobs, chat)}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(text)}
    else:
        choice["text"] = "".join(text)
    return {"id": first.get("id"), "created": first.get("created"), "model": first.get("model"),
            "object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}
