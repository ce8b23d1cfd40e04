"""What the router reads from a request body: OpenAI's service tiers as admission classes, its
prompt_cache_key as the placement key ahead of the prompt's prefix, and its end-user keys."""

from __future__ import annotations

import pytest

from shoal.router.placement.route_request import RequestError, route_request


def routed(headers: dict | None = None, text: str = "hello there", **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], **fields}
    return route_request(body, headers or {}, chat=True, chars_per_token=4.0, default_decode_tokens=16)


@pytest.mark.parametrize(
    ("tier", "priority"),
    [
        ("priority", "critical"),
        ("flex", "sheddable"),
        ("auto", "standard"),
        ("default", "standard"),
        (None, "standard"),
    ],
)
def test_service_tiers_are_admission_classes(tier, priority):
    assert routed(service_tier=tier).priority == priority


def test_shoals_own_priority_comes_before_the_tier_and_a_bad_tier_is_named():
    assert routed({"x-shoal-priority": "sheddable"}, service_tier="priority").priority == "sheddable"
    assert routed(priority="critical", service_tier="flex").priority == "critical"
    with pytest.raises(RequestError) as refused:
        routed(service_tier="scale")
    assert refused.value.param == "service_tier"


def test_a_prompt_cache_key_is_a_shared_first_block_and_the_session():
    long = "x" * 400
    a, b = routed(text=long, prompt_cache_key="agent-7"), routed(text="y" * 400, prompt_cache_key="agent-7")
    assert a.prefix_blocks[0] == b.prefix_blocks[0] and a.session_key == "agent-7"
    assert not set(a.prefix_blocks[1:]) & set(b.prefix_blocks)  # the texts share nothing beyond the key
    other = routed(text=long, prompt_cache_key="agent-8")
    assert not set(a.prefix_blocks) & set(other.prefix_blocks)  # another key: another cache
    plain = routed(text=long)
    assert len(plain.prefix_blocks) == len(a.prefix_blocks) - 1 and not set(plain.prefix_blocks) & set(a.prefix_blocks)
    with pytest.raises(RequestError) as refused:
        routed(prompt_cache_key="")
    assert refused.value.param == "prompt_cache_key"


def test_the_end_user_is_the_safety_identifier_else_the_user():
    assert routed(safety_identifier="s", user="u").session_key == "s"
    assert routed(safety_identifier="s", user="u").end_user == "s" and routed().end_user is None
    assert routed(user="u").session_key == "u"
    assert routed({"x-session-id": "h"}, user="u").session_key == "h"
    assert routed({"x-session-id": "h"}, prompt_cache_key="k").session_key == "k"
