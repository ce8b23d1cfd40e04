"""A planned move of a stream from one worker to another, with its KV cache.

A router that can continue a stream elsewhere says so with the HANDOFF_HEADER on its request. A
worker may then end that stream, instead of with `[DONE]`, with one handoff event: the stream is
not over, it is to go on elsewhere (a prefill worker after the first token, a draining worker at
its next token), and the KV of its tokens so far can be fetched from the worker's KV peer
(`kv_peer`, None when it has none: the next worker recomputes). The router continues the stream on
another worker as for a failover (prompt plus token ids, same seed) and names the peer in the
continuation's `kv_source`, so that worker imports the blocks instead of computing them.

A handoff is not a failure: the worker is not marked down and the router's migration limit does
not count it (MAX_HANDOFFS bounds them instead).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shoal.protocol.sse import data_event

HANDOFF_HEADER = "x-shoal-handoff"
ACCEPTS_KV_HANDOFF = "kv"  # the header's value
MAX_HANDOFFS = 4  # per stream: a prefill handoff, then drains on the way

Reason = Literal["prefill", "drain"]


class Handoff(msgspec.Struct, frozen=True, kw_only=True):
    reason: Reason
    kv_peer: str | None = None


class _Event(msgspec.Struct, frozen=True):
    shoal_handoff: Handoff


def handoff_event(handoff: Handoff) -> bytes:
    """The `data:` event that ends a stream handed off."""
    return data_event(msgspec.json.encode(_Event(handoff)))


def handoff_of(event: dict) -> Handoff | None:
    """The handoff an event announces, None for any other event; ValueError for a malformed one."""
    if "shoal_handoff" not in event:
        return None
    try:
        return msgspec.convert(event, _Event).shoal_handoff
    except msgspec.ValidationError as exc:
        raise ValueError(f"a malformed handoff event: {exc}") from None
