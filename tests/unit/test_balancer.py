"""The balancer (shoal.router.placement.balancer): the policy is asked only when there is a choice, and every
placement leaves an in-flight entry on its worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shoal.protocol.worker_load import WorkerLoad
from shoal.router.config import HealthSettings
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.membership import Membership
from shoal.router.placement.balancer import Balancer
from shoal.router.placement.policies import make_policy
from shoal.router.views import RouteRequest


class CountingPolicy:
    """Round robin that counts how often it was asked."""

    name = "counting"

    def __init__(self):
        self.inner, self.asked = make_policy("round_robin"), 0

    def choose(self, request, workers, context):
        self.asked += 1
        return self.inner.choose(request, workers, context)


def test_the_policy_is_asked_only_when_more_than_one_worker_can_take_the_request():
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))
    for name in ("a", "b"):
        membership.register(f"http://{name}", ["m"], WorkerLoad(running=0, waiting=0))
    policy = CountingPolicy()
    balancer = Balancer(policy, membership)
    request = RouteRequest(model="m", prompt_tokens=10, expected_decode_tokens=5)

    both = [balancer.place(request) for _ in range(4)]
    assert policy.asked == 4 and {p.worker.worker_id for p in both} == {"http://a", "http://b"}

    alone = balancer.place(request, exclude=frozenset({"http://a"}))
    assert policy.asked == 4 and alone.worker.worker_id == "http://b"
    assert len(alone.worker.in_flight) == 3  # two of the four, and this one
    balancer.release(alone)
    assert len(alone.worker.in_flight) == 2
