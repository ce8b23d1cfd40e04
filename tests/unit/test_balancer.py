"""The balancer (shoal.router.placement.balancer): the policy is asked only when there is a choice, and every
placement leaves an in-flight entry on its worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from shoal.protocol.prefix_keys import prefix_blocks
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


class ContextRecorder:
    """Places every request on `target`, keeping the context it was shown."""

    name = "recorder"

    def __init__(self, target: str):
        self.target, self.contexts = target, []

    def choose(self, request, workers, context):
        self.contexts.append(context)
        return next(w for w in workers if w.worker_id == self.target)


def test_a_server_that_reports_nothing_is_believed_to_hold_only_the_last_prompt_it_was_sent():
    """llama-cpp-python keeps one sequence and serves in the order sent: of two conversations with a
    shared system prompt sent there, it holds the second once both are done, whichever ended last,
    and the first is no home there. A shoal worker keeps both."""
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))
    membership.register("http://shoal", ["m"], WorkerLoad(running=0, waiting=0, num_kv_blocks=1000, block_size=16))
    llama = membership.register("http://llama", ["m"], None)
    llama.load_source = "router"

    def request(text: str) -> RouteRequest:
        return RouteRequest(
            model="m", prompt_tokens=len(text) // 4, expected_decode_tokens=5, prefix_blocks=prefix_blocks(text)
        )

    system = "You are a helpful assistant who answers briefly. " * 4
    first, second = request(system + "First conversation, first question. " * 4), request(system + "Another one. " * 6)
    for worker_id in ("http://llama", "http://shoal"):
        balancer = Balancer(ContextRecorder(worker_id), membership)
        placements = [balancer.place(first), balancer.place(second)]
        balancer.release(placements[1])
        balancer.release(placements[0])  # the first ends last
        balancer.place(first)
        context = balancer.policy.contexts[-1]
        if worker_id == "http://llama":
            shared = len(prefix_blocks(system))
            assert context.matched_blocks[worker_id] == context.placed_blocks[worker_id] == shared
            assert context.eviction_pressure(worker_id) == 0.0
        else:
            assert context.matched_blocks[worker_id] == len(first.prefix_blocks)
