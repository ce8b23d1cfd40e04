"""Fair shares in admission: with one slot and everyone waiting, a tenant sending ten times the others
gets its share of the tokens admitted and no more (each backlogged tenant within 10% of its weight's
share), weights give larger shares, a tenant idle for a while banks no credit, and priorities still
come first."""

from __future__ import annotations

import asyncio

from shoal.router.admission.queues import Admission, Share

LIMITS = {"critical": 1000, "standard": 1000, "sheddable": 1000}


def admitted_in_order(requests: list[tuple[str, Share]], admissions: int) -> list[str]:
    """The tenants of the first `admissions` requests admitted, one slot freed at a time, when
    `requests` (priority, share) all queue behind a request holding the only slot."""

    async def run() -> list[str]:
        admission = Admission(lambda model: 1, LIMITS, queue_timeout_s=60)
        assert admission.try_admit("m", "standard", Share("holder"))
        order: list[str] = []

        async def one(priority: str, share: Share) -> None:
            await admission.admit("m", priority, share=share)
            order.append(share.tenant)

        tasks = [asyncio.create_task(one(priority, share)) for priority, share in requests]
        await asyncio.sleep(0)
        for _ in range(admissions):
            admission.release("m")
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order[:admissions]

    return asyncio.run(run())


def shares(order: list[str], tokens: dict[str, int]) -> dict[str, float]:
    served = {tenant: order.count(tenant) * tokens[tenant] for tenant in tokens}
    total = sum(served.values())
    return {tenant: served[tenant] / total for tenant in tokens}


def test_a_tenant_sending_ten_times_the_others_gets_its_share_and_no_more():
    tokens = {"heavy": 100, "a": 100, "b": 100}
    requests = [("standard", Share("heavy", 100))] * 100  # all queued first
    requests += [("standard", Share(t, 100)) for t in ("a", "b") for _ in range(10)]
    order = admitted_in_order(requests, 30)  # every tenant backlogged throughout
    for tenant, share in shares(order, tokens).items():
        assert abs(share - 1 / 3) <= 0.1 / 3, (tenant, order)


def test_shares_follow_weights_and_tokens_not_request_counts():
    """a weighs 2: twice b's tokens while both wait; c's requests are 4 times as long: a quarter as many."""
    requests = [("standard", Share("a", 100, 2.0))] * 40 + [("standard", Share("b", 100))] * 40
    requests += [("standard", Share("c", 400))] * 10
    order = admitted_in_order(requests, 28)
    got = shares(order, {"a": 100, "b": 100, "c": 400})
    for tenant, weight in {"a": 0.5, "b": 0.25, "c": 0.25}.items():
        assert abs(got[tenant] - weight) <= 0.1 * weight, (got, order)


def test_one_tenant_alone_is_served_in_arrival_order():
    requests = [("standard", Share("only", n + 1)) for n in range(5)]

    async def run() -> list[int]:
        admission = Admission(lambda model: 1, LIMITS, queue_timeout_s=60)
        assert admission.try_admit("m", "standard", Share("only"))
        order = []

        async def one(share: Share) -> None:
            await admission.admit("m", "standard", share=share)
            order.append(share.tokens)
            admission.release("m")

        await asyncio.gather(*(one(share) for _, share in requests), _release_soon(admission))
        return order

    assert asyncio.run(run()) == [1, 2, 3, 4, 5]


def test_an_idle_tenant_banks_no_credit_and_priorities_come_first():
    async def run() -> list[str]:
        admission = Admission(lambda model: 1, LIMITS, queue_timeout_s=60)
        for _ in range(50):  # busy alone: its counter grows while "late" is idle
            assert admission.try_admit("m", "standard", Share("busy", 100))
            admission.release("m")
        assert admission.try_admit("m", "standard", Share("holder"))
        order: list[str] = []

        async def one(priority: str, tenant: str) -> None:
            await admission.admit("m", priority, share=Share(tenant, 100))
            order.append(tenant)

        tasks = [asyncio.create_task(one("standard", "busy")) for _ in range(10)]
        tasks += [asyncio.create_task(one("standard", "late")) for _ in range(10)]
        tasks.append(asyncio.create_task(one("critical", "urgent")))
        await asyncio.sleep(0)
        for _ in range(9):
            admission.release("m")
            await asyncio.sleep(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order

    order = asyncio.run(run())
    assert order[0] == "urgent"
    # "late" starts level with the virtual time, not 50 requests behind "busy": they alternate.
    assert order[1:].count("late") == 4 and order[1:].count("busy") == 4, order


async def _release_soon(admission: Admission) -> None:
    await asyncio.sleep(0)
    admission.release("m")
