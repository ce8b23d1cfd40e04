"""Balancing policies by name. Each is a small class whose choose() is a pure function of
(request, eligible worker views, routing context). The peer_* ones are the peers' policies written
from their published descriptions, to compare against in the simulator and on a cluster."""

from __future__ import annotations

from shoal.router.config import POLICY_NAMES
from shoal.router.placement.policies.base import Policy, eligible
from shoal.router.placement.policies.cache_aware import CacheAware
from shoal.router.placement.policies.cost import CostPolicy
from shoal.router.placement.policies.least_outstanding import LeastOutstandingTokens
from shoal.router.placement.policies.peer_dynamo import DynamoKVCost
from shoal.router.placement.policies.peer_llm_d import LlmDWeightedScorers
from shoal.router.placement.policies.peer_llm_d_latency import LlmDPredictedLatency
from shoal.router.placement.policies.peer_ray_serve import RayPrefixAffinity
from shoal.router.placement.policies.peer_sglang import SGLangCacheAware
from shoal.router.placement.policies.power_of_two import PowerOfTwoChoices
from shoal.router.placement.policies.round_robin import RoundRobin
from shoal.router.placement.policies.session_affinity import SessionAffinity

POLICIES = {
    policy.name: policy
    for policy in (
        RoundRobin,
        LeastOutstandingTokens,
        PowerOfTwoChoices,
        CacheAware,
        SessionAffinity,
        CostPolicy,
        SGLangCacheAware,
        LlmDWeightedScorers,
        LlmDPredictedLatency,
        DynamoKVCost,
        RayPrefixAffinity,
    )
}
if tuple(POLICIES) != POLICY_NAMES:
    raise ImportError(f"the router config names the policies {POLICY_NAMES}, the policies are {tuple(POLICIES)}")


def make_policy(name: str, **options) -> Policy:
    """Builds a policy by name; unknown names and options are errors that say what exists."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**options)


__all__ = ["POLICIES", "Policy", "eligible", "make_policy"]
