"""Pipeline partitioning across heterogeneous nodes: which contiguous layers each stage holds.

Each stage (a node, in pipeline order) gets at least one layer; the first also holds the embedding
and the last the LM head. A stage's time per step is its layers × the node's measured time per
layer (plus the embedding's or the head's); its memory is its layers × the bytes per layer
(weights and KV cache) plus the embedding's or head's, and must fit the node's free memory. The
plan minimises the slowest stage's time, which bounds the pipeline's throughput: memory only
constrains, so a slow node with much memory does not get most layers. Exact, by dynamic
programming over (stage, layers placed so far).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class StageNode:
    name: str
    seconds_per_layer: float
    free_bytes: int


@dataclass(frozen=True)
class ModelCost:
    num_layers: int
    layer_bytes: int
    embed_bytes: int = 0
    head_bytes: int = 0
    embed_seconds: float = 0.0
    head_seconds: float = 0.0


class PartitionError(ValueError):
    """No assignment fits the nodes' memory (or there are more stages than layers)."""


@dataclass(frozen=True)
class Stage:
    node: StageNode
    first_layer: int
    end_layer: int  # exclusive
    seconds: float
    bytes: int


@dataclass(frozen=True)
class PartitionPlan:
    stages: tuple[Stage, ...]

    @property
    def slowest_stage_s(self) -> float:
        return max(stage.seconds for stage in self.stages)

    @property
    def layers_per_stage(self) -> list[int]:
        return [stage.end_layer - stage.first_layer for stage in self.stages]

    def describe(self) -> str:
        """The plan as a table, one line per stage (what `shoal serve` prints)."""
        lines = [f"{'stage':>5}  {'node':<16} {'layers':>9}  {'ms/step':>8}  {'memory':>10}"]
        for index, stage in enumerate(self.stages):
            extra = (" +embed" if index == 0 else "") + (" +head" if index == len(self.stages) - 1 else "")
            lines.append(
                f"{index:>5}  {stage.node.name:<16} {stage.first_layer:>3}-{stage.end_layer - 1:<3}  "
                f"{stage.seconds * 1e3:>8.2f}  {stage.bytes / 2**20:>7.0f} MiB{extra}"
            )
        return "\n".join(lines)


def stage_cost(nodes: list[StageNode], model: ModelCost, index: int, layers: int) -> tuple[float, int]:
    """(seconds, bytes) of stage `index` holding `layers` layers."""
    node, first, last = nodes[index], index == 0, index == len(nodes) - 1
    seconds = (
        layers * node.seconds_per_layer + (model.embed_seconds if first else 0) + (model.head_seconds if last else 0)
    )
    size = layers * model.layer_bytes + (model.embed_bytes if first else 0) + (model.head_bytes if last else 0)
    return seconds, size


def plan_partition(nodes: list[StageNode], model: ModelCost) -> PartitionPlan:
    """The plan with the smallest slowest-stage time; among equals, the earliest stages take more
    layers. Raises PartitionError when nothing fits."""
    count, total = len(nodes), model.num_layers
    if not 1 <= count <= total:
        raise PartitionError(f"{count} stages cannot share {total} layers (each stage needs at least one)")

    @cache
    def best(index: int, placed: int) -> tuple[float, tuple[int, ...]] | None:
        """Slowest time and layer counts for stages index.. given `placed` layers before them."""
        remaining = total - placed
        if index == count - 1:
            seconds, size = stage_cost(nodes, model, index, remaining)
            return (seconds, (remaining,)) if size <= nodes[index].free_bytes else None
        choice = None
        for layers in range(remaining - (count - index - 1), 0, -1):  # leave one layer per later stage
            seconds, size = stage_cost(nodes, model, index, layers)
            if size > nodes[index].free_bytes:
                continue
            rest = best(index + 1, placed + layers)
            if rest is None:
                continue
            candidate = (max(seconds, rest[0]), (layers, *rest[1]))
            if choice is None or candidate[0] < choice[0]:
                choice = candidate
        return choice

    found = best(0, 0)
    if found is None:
        raise PartitionError("the model does not fit these nodes' free memory in any split")
    return plan_from_counts(nodes, model, list(found[1]))


def plan_from_counts(nodes: list[StageNode], model: ModelCost, layers_per_stage: list[int]) -> PartitionPlan:
    """A given split (a config's override), checked: one count per node, each at least 1, summing
    to the model's layers, each stage within its node's memory."""
    if len(layers_per_stage) != len(nodes) or sum(layers_per_stage) != model.num_layers or min(layers_per_stage) < 1:
        raise PartitionError(
            f"layers_per_stage {layers_per_stage} must give each of the {len(nodes)} stages at "
            f"least one layer and {model.num_layers} in all"
        )
    stages, first = [], 0
    for index, layers in enumerate(layers_per_stage):
        seconds, size = stage_cost(nodes, model, index, layers)
        if size > nodes[index].free_bytes:
            raise PartitionError(
                f"stage {index} ({nodes[index].name}) needs {size / 2**20:.0f} MiB for {layers} "
                f"layers; {nodes[index].free_bytes / 2**20:.0f} MiB are free"
            )
        stages.append(Stage(nodes[index], first, first + layers, seconds, size))
        first += layers
    return PartitionPlan(tuple(stages))
