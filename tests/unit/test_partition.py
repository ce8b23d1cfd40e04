"""Pipeline partition plans against brute force over every split, on heterogeneous node sets."""

from __future__ import annotations

import itertools
import random

import pytest

from shoal.parallel.partition import (
    ModelCost,
    PartitionError,
    StageNode,
    plan_from_counts,
    plan_partition,
    stage_cost,
)

MiB = 2**20


def brute_force(nodes: list[StageNode], model: ModelCost) -> float | None:
    """The smallest slowest-stage time over every split that fits, or None."""
    best = None
    for cuts in itertools.combinations(range(1, model.num_layers), len(nodes) - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, model.num_layers))]
        costs = [stage_cost(nodes, model, i, layers) for i, layers in enumerate(counts)]
        if all(size <= node.free_bytes for (_, size), node in zip(costs, nodes)):
            slowest = max(seconds for seconds, _ in costs)
            best = slowest if best is None else min(best, slowest)
    return best


def random_case(rng: random.Random) -> tuple[list[StageNode], ModelCost]:
    model = ModelCost(
        num_layers=rng.randint(4, 12),
        layer_bytes=rng.choice([10, 20, 40]) * MiB,
        embed_bytes=rng.choice([0, 30]) * MiB,
        head_bytes=rng.choice([0, 30]) * MiB,
        embed_seconds=rng.choice([0, 0.002]),
        head_seconds=rng.choice([0, 0.004]),
    )
    nodes = [
        StageNode(f"n{i}", rng.choice([0.001, 0.002, 0.005, 0.01]), rng.randint(2, 12) * 40 * MiB)
        for i in range(rng.randint(1, min(4, model.num_layers)))
    ]
    return nodes, model


@pytest.mark.parametrize("seed", range(200))
def test_the_plan_is_as_good_as_the_best_split_that_fits(seed):
    nodes, model = random_case(random.Random(seed))
    expected = brute_force(nodes, model)
    if expected is None:
        with pytest.raises(PartitionError):
            plan_partition(nodes, model)
        return
    plan = plan_partition(nodes, model)
    assert plan.slowest_stage_s == pytest.approx(expected)
    assert sum(plan.layers_per_stage) == model.num_layers and min(plan.layers_per_stage) >= 1
    assert all(stage.bytes <= stage.node.free_bytes for stage in plan.stages)
    assert [s.first_layer for s in plan.stages] == [0, *[s.end_layer for s in plan.stages[:-1]]]


def test_a_slow_node_with_much_memory_does_not_get_most_layers():
    model = ModelCost(num_layers=30, layer_bytes=100 * MiB)
    fast = StageNode("fast-gpu", 0.001, 2000 * MiB)  # room for 20 layers
    slow = StageNode("slow-cpu", 0.004, 64000 * MiB)  # room for everything
    plan = plan_partition([slow, fast], model)
    assert plan.layers_per_stage == [10, 20]  # memory caps the fast node; a memory-only split gives slow 29
    assert plan.slowest_stage_s == pytest.approx(0.04)
    even = plan_partition(
        [StageNode("a", 0.002, 10**12), StageNode("b", 0.002, 10**12), StageNode("c", 0.004, 10**12)],
        ModelCost(num_layers=10, layer_bytes=1),
    )
    assert even.layers_per_stage == [4, 4, 2]


def test_an_override_is_checked_and_the_plan_prints_one_line_per_stage():
    nodes = [StageNode("a", 0.001, 500 * MiB), StageNode("b", 0.001, 500 * MiB)]
    model = ModelCost(num_layers=8, layer_bytes=100 * MiB, embed_bytes=50 * MiB, head_bytes=50 * MiB)
    plan = plan_from_counts(nodes, model, [4, 4])
    assert plan.layers_per_stage == [4, 4] and plan.stages[1].first_layer == 4
    text = plan.describe()
    assert len(text.splitlines()) == 3 and "+embed" in text.splitlines()[1] and "+head" in text.splitlines()[2]
    with pytest.raises(PartitionError, match="needs 550 MiB for 5 layers"):
        plan_from_counts(nodes, model, [5, 3])
    with pytest.raises(PartitionError, match="at least one layer and 8 in all"):
        plan_from_counts(nodes, model, [8, 0])
    with pytest.raises(PartitionError, match="cannot share"):
        plan_partition(nodes * 5, model)
