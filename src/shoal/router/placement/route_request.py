"""Turns a client's OpenAI request body into the RouteRequest policies reason about."""

from __future__ import annotations

from collections.abc import Mapping

from shoal.protocol.admission_class import BATCH, PRIORITY_HEADER
from shoal.protocol.prefix_keys import BLOCK_CHARS, canonical_chat, canonical_completion, prefix_blocks
from shoal.router.views import RouteRequest

SESSION_HEADERS = ("x-session-id", "x-shoal-session")
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
PRIORITIES = ("critical", "standard", "sheddable")
# The lowest class, below sheddable: work the router runs on idle capacity (batches). It is asked
# for with the x-shoal-priority header only (workers know the three classes of a body).
BATCH_PRIORITY = BATCH
# OpenAI's service tiers as admission classes ("auto" and "default": the standard class).
TIER_PRIORITIES = {"priority": "critical", "flex": "sheddable", "auto": "standard", "default": "standard"}
# Who the request is for: OpenAI's safety_identifier, else its older `user`.
END_USER_FIELDS = ("safety_identifier", "user")
ROUTER_ONLY_FIELDS = ("kv_source",)  # a worker imports KV from the peer it names
# Chat templates add a few tokens per message (role markers, separators).
TEMPLATE_TOKENS_PER_MESSAGE = 4


class RequestError(ValueError):
    """The body cannot be routed; `param` names the field (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def route_request(
    body: dict, headers: dict[str, str], chat: bool, chars_per_token: float, default_decode_tokens: int
) -> RouteRequest:
    """Raises RequestError for what the router itself needs and cannot find (model, prompt), and
    for a field only routers set."""
    for field in ROUTER_ONLY_FIELDS:
        if field in body:
            raise RequestError(f"`{field}` is set by shoal's routers, not by clients", field)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("`model` is required and must be a string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("`messages` must be a non-empty list", "messages")
        # Tools reach the prompt ahead of the conversation (in the system message or the template's
        # tools section): they count, and requests with the same tools share that prefix.
        text = canonical_chat(messages, body.get("tools"), body.get("tool_choice")).text
        prompt_tokens = int(len(text) / chars_per_token) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, prompt_tokens = canonical_completion(prompt).text, len(prompt)
        elif isinstance(prompt, str):
            text, prompt_tokens = prompt, int(len(prompt) / chars_per_token) + 1
        else:
            raise RequestError("`prompt` must be a string or a list of token ids", "prompt")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    decode = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else default_decode_tokens
    tier = body.get("service_tier")
    if tier is not None and tier not in TIER_PRIORITIES:
        raise RequestError(f"service_tier must be one of {', '.join(TIER_PRIORITIES)}", "service_tier")
    priority = _priority(headers, body.get("priority") or TIER_PRIORITIES.get(tier, "standard"))
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not (isinstance(cache_key, str) and cache_key):
        raise RequestError("`prompt_cache_key` must be a non-empty string", "prompt_cache_key")
    end_user = next((body[f] for f in END_USER_FIELDS if isinstance(body.get(f), str) and body[f]), None)
    session = cache_key or next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None) or end_user
    return RouteRequest(
        model=model,
        prompt_tokens=max(1, prompt_tokens),
        expected_decode_tokens=decode,
        prefix_blocks=prefix_blocks(text, cache_key=cache_key),
        chars_per_token=chars_per_token,
        block_chars=BLOCK_CHARS,
        session_key=session if isinstance(session, str) else None,
        priority=priority,
        end_user=end_user,
    )


def embedding_route_request(body: dict, headers: dict[str, str], chars_per_token: float) -> RouteRequest:
    """An embeddings request as policies see it: its inputs' tokens (estimated for texts), no
    output, no prefix to find cached (an embedding's prompt is not kept); its class as a
    completion's. Raises RequestError for a missing model or input."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("`model` is required and must be a string", "model")
    inputs = body.get("input")
    items = (
        [inputs]
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int))
        else inputs
    )
    if not isinstance(items, list) or not items:
        raise RequestError("`input` must be a string, token ids, or a non-empty list of either", "input")
    tokens = sum(
        int(len(item) / chars_per_token) + 1 if isinstance(item, str) else len(item)
        for item in items
        if isinstance(item, str | list)
    )
    priority = _priority(headers, "standard")
    user = body.get("user")
    return RouteRequest(
        model=model,
        prompt_tokens=max(1, tokens),
        expected_decode_tokens=0,
        prefix_blocks=(),
        chars_per_token=chars_per_token,
        block_chars=BLOCK_CHARS,
        session_key=user if isinstance(user, str) and user else None,
        priority=priority,
        end_user=user if isinstance(user, str) and user else None,
    )


def _priority(headers: Mapping[str, str], otherwise: str) -> str:
    """The admission class: the x-shoal-priority header's (any class, batch included), else the body's."""
    if PRIORITY_HEADER in headers:
        priority = headers[PRIORITY_HEADER]
        if priority not in (*PRIORITIES, BATCH_PRIORITY):
            raise RequestError(f"priority must be one of {', '.join((*PRIORITIES, BATCH_PRIORITY))}", "priority")
        return priority
    if otherwise not in PRIORITIES:
        raise RequestError(f"priority must be one of {', '.join(PRIORITIES)}", "priority")
    return otherwise
