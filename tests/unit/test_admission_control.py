"""Router admission: slots per model, priority queues, eviction of lower classes, timeouts; and the
per-key rate limiter and API keys."""

from __future__ import annotations

import asyncio

import pytest

from shoal.router.admission import auth
from shoal.router.admission.auth import ApiKeys, key_hash
from shoal.router.admission.queues import Admission, Refused
from shoal.router.admission.rate_limit import RateLimiter
from shoal.router.config import RouterConfig

LIMITS = {"critical": 4, "standard": 4, "sheddable": 4}


def run(coroutine):
    return asyncio.run(coroutine)


def test_waiters_are_admitted_by_class_then_arrival():
    async def scenario():
        admission = Admission(lambda m: 1, LIMITS, queue_timeout_s=5)
        await admission.admit("m", "standard")  # holds the only slot
        order = []

        async def wait(name, priority):
            await admission.admit("m", priority)
            order.append(name)

        tasks = [
            asyncio.create_task(wait(n, p))
            for n, p in [("s1", "sheddable"), ("t1", "standard"), ("c1", "critical"), ("t2", "standard")]
        ]
        await asyncio.sleep(0.01)
        assert admission.queued() == {"critical": 1, "standard": 2, "sheddable": 1}
        for _ in range(4):
            admission.release("m")
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return order

    assert run(scenario()) == ["c1", "t1", "t2", "s1"]


def test_batch_work_takes_only_idle_slots_and_never_queues():
    async def scenario():
        admission = Admission(lambda m: 2, LIMITS, queue_timeout_s=5)
        await admission.admit("m", "batch")  # an idle slot: taken
        await admission.admit("m", "standard")
        with pytest.raises(Refused) as full:  # no slot: refused at once, not queued
            await admission.admit("m", "batch")
        assert full.value.status == 429 and admission.queued() == {"critical": 0, "standard": 0, "sheddable": 0}
        waiter = asyncio.create_task(admission.admit("m", "sheddable"))
        await asyncio.sleep(0.01)
        admission.release("m")  # the slot goes to the waiting sheddable request, not to batch work
        await waiter
        assert not admission.try_admit("m", "batch")
        admission.release("m")
        waiter = asyncio.create_task(admission.admit("other", "standard"))
        await waiter
        assert admission.try_admit("m", "batch")  # a free slot and nobody waiting for "m"
        assert admission.shed["batch"] == 1

    run(scenario())


def test_a_new_request_does_not_overtake_waiters_of_its_class():
    async def scenario():
        admission = Admission(lambda m: 1, LIMITS, queue_timeout_s=5)
        await admission.admit("m", "standard")
        waiting = asyncio.create_task(admission.admit("m", "standard"))
        await asyncio.sleep(0.01)
        admission.slots.give_back("m")  # a slot frees without wake-up: a newcomer must still queue
        late = asyncio.create_task(admission.admit("m", "standard"))
        await asyncio.sleep(0.01)
        assert not late.done() and admission.queued()["standard"] == 2
        admission.wake()
        await asyncio.sleep(0.01)
        assert waiting.done() and not late.done()
        late.cancel()

    run(scenario())


def test_full_queues_refuse_with_429_but_critical_evicts_lower_classes_first():
    async def scenario():
        admission = Admission(lambda m: 0, {"critical": 1, "standard": 1, "sheddable": 1}, queue_timeout_s=5)
        shed = asyncio.create_task(admission.admit("m", "sheddable"))
        std = asyncio.create_task(admission.admit("m", "standard"))
        crit = asyncio.create_task(admission.admit("m", "critical"))
        await asyncio.sleep(0.01)
        with pytest.raises(Refused) as full:
            await admission.admit("m", "sheddable")
        assert full.value.status == 429
        second_critical = asyncio.create_task(admission.admit("m", "critical"))
        await asyncio.sleep(0.01)
        with pytest.raises(Refused):
            await shed  # the sheddable waiter made room for the critical one
        third_critical = asyncio.create_task(admission.admit("m", "critical"))
        await asyncio.sleep(0.01)
        with pytest.raises(Refused):
            await std
        with pytest.raises(Refused) as last:
            await admission.admit("m", "critical")  # nothing lower left to evict
        assert last.value.status == 429
        for task in (crit, second_critical, third_critical):
            task.cancel()

    run(scenario())


def test_waiting_past_the_timeout_is_a_503():
    async def scenario():
        admission = Admission(lambda m: 0, LIMITS, queue_timeout_s=0.05)
        with pytest.raises(Refused) as refused:
            await admission.admit("m", "standard")
        assert refused.value.status == 503 and admission.queued()["standard"] == 0

    run(scenario())


def test_rate_limiter_counts_requests_and_tokens_and_says_how_long_to_wait():
    limiter = RateLimiter()
    assert limiter.check([("k", 2, None)], 10) == 0 and limiter.check([("k", 2, None)], 10) == 0
    wait = limiter.check([("k", 2, None)], 10)
    assert 0 < wait <= 30
    assert limiter.check([("other", 2, None)], 10) == 0
    assert limiter.check([("t", None, 100)], 80) == 0 and limiter.check([("t", None, 100)], 80) > 0
    assert limiter.check([("t", None, 100)], 1000) == float("inf")


def test_an_end_user_over_its_limit_takes_nothing_from_its_keys_buckets():
    keys = ApiKeys(RouterConfig(api_keys=[{"name": "a", "sha256": key_hash("s"), "end_user_requests_per_minute": 1}]))
    client = keys.authenticate("Bearer s")
    limiter = RateLimiter()
    assert limiter.check(client.limits("u1"), 5) == 0 and limiter.check(client.limits("u2"), 5) == 0
    assert limiter.check(client.limits("u1"), 5) > 0  # u1's second request this minute
    assert limiter.check(client.limits(None), 5) == 0  # the key itself is unlimited
    limited = ApiKeys(RouterConfig(api_keys=[{"sha256": key_hash("t"), "requests_per_minute": 2}])).authenticate(
        "Bearer t"
    )
    assert limiter.check(limited.limits("u"), 1) == 0 and limiter.check(limited.limits("u"), 1) == 0
    assert limiter.check(limited.limits("v"), 1) > 0  # the key's own limit, whoever the end user


def test_api_keys_by_hash_and_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEYS", "raw-key-1, raw-key-2")
    config = RouterConfig(api_keys=[{"name": "team-a", "sha256": key_hash("secret-a"), "requests_per_minute": 5}])
    keys = ApiKeys(config)
    assert keys.authenticate("Bearer secret-a").name == "team-a"
    assert keys.authenticate("Bearer secret-a").requests_per_minute == 5
    assert keys.authenticate("Bearer raw-key-2").name == f"key-{key_hash('raw-key-2')[:8]}"
    assert keys.authenticate("Bearer nope") is None and keys.authenticate(None) is None
    monkeypatch.delenv("SHOAL_API_KEYS")
    assert ApiKeys(RouterConfig()).authenticate(None).name == "anonymous"


def test_accepted_keys_are_remembered_up_to_a_bound_and_wrong_ones_never(monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEYS", "key-1,key-2,key-3")
    monkeypatch.setattr(auth, "KNOWN_KEYS", 2)
    keys = ApiKeys(RouterConfig())
    names = [keys.authenticate(f"Bearer key-{i}").name for i in (1, 2, 3, 1)]
    assert names == [f"key-{key_hash(f'key-{i}')[:8]}" for i in (1, 2, 3, 1)]
    assert 0 < len(keys.known) <= 2
    assert keys.authenticate("Bearer key-4") is None and "Bearer key-4" not in keys.known


def test_the_readme_router_config_is_valid():
    import re
    from pathlib import Path

    import yaml

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", readme[readme.index("## Router") :], re.S).group(1)
    config = RouterConfig(**yaml.safe_load(block))
    assert config.policy == "cost" and config.models["llama-70b"].fallbacks == ["llama-8b"]
