"""A pipeline's layout: its stage servers started or linked, every node measured (stage_profile),
the layers each stage holds planned from those figures, and the KV blocks every stage can afford.

Nodes on one host and device (the head and the stage processes it starts, or several stage servers
on one machine) share that device's free memory equally. A stage's memory is its layers' weights,
plus room for one sequence of the model's full length in their KV cache, plus the embedding on the
first stage and the LM head on the last; its time is its layers at its node's measured speed, the
last stage adding the LM head's work in layer-equivalents at that node's speed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from shoal.config.engine import EngineConfig
from shoal.model.config import LlamaConfig
from shoal.model.llama import kv_bytes_per_token_per_layer
from shoal.model.loader import Checkpoint
from shoal.parallel.partition import ModelCost, PartitionPlan, StageNode, plan_from_counts, plan_partition
from shoal.parallel.pipeline_stage import wire_dtype
from shoal.parallel.stage_links import StageHandle, StageLinks
from shoal.parallel.stage_profile import NodeProfile, measure_node
from shoal.runner.memory import num_kv_blocks


def layer_values(config: LlamaConfig) -> int:
    """Weights of one decoder layer (attention and MLP projections), in values."""
    hidden = config.hidden_size
    attention = hidden * config.head_dim * 2 * (config.num_heads + config.num_kv_heads)
    return attention + 3 * hidden * config.intermediate_size


def shared_free_bytes(profiles: list[NodeProfile]) -> list[int]:
    """Each node's share of its host and device's free memory."""
    sharing = Counter(profile.location for profile in profiles)
    return [profile.free_bytes // sharing[profile.location] for profile in profiles]


def plan_stages(
    config: LlamaConfig,
    profiles: list[NodeProfile],
    names: list[str],
    layers_per_stage: tuple[int, ...] | None,
    bytes_per_value: int,
    max_model_len: int,
) -> PartitionPlan:
    """The plan minimising the slowest stage over these nodes (in pipeline order, the head first),
    or the `layers_per_stage` override, checked against the nodes' memory."""
    head_values = config.vocab_size * config.hidden_size
    model = ModelCost(
        num_layers=config.num_layers,
        layer_bytes=layer_values(config) * bytes_per_value
        + kv_bytes_per_token_per_layer(config, bytes_per_value) * max_model_len,
        embed_bytes=head_values * bytes_per_value,
        head_bytes=head_values * bytes_per_value,
        head_seconds=profiles[-1].seconds_per_layer * head_values / layer_values(config),
    )
    nodes = [
        StageNode(name, profile.seconds_per_layer, free)
        for name, profile, free in zip(names, profiles, shared_free_bytes(profiles))
    ]
    if layers_per_stage:
        return plan_from_counts(nodes, model, list(layers_per_stage))
    return plan_partition(nodes, model)


def pipeline_kv_blocks(
    config: LlamaConfig,
    plan: PartitionPlan,
    budget_bytes: int | None,
    kv_fraction: float,
    block_size: int,
    bytes_per_value: int,
    wire_bytes_per_value: int,
    max_useful_tokens: int,
) -> int:
    """The KV blocks every stage can hold (they share one block layout). Per token, a stage keeps
    its layers' KV and, unless it is the last, one boundary-log row of outgoing activations. Its
    budget is `budget_bytes` when given, else `kv_fraction` of its node's free memory after its
    weights."""
    kv_per_layer = kv_bytes_per_token_per_layer(config, bytes_per_value)
    log_row = config.hidden_size * wire_bytes_per_value
    affordable = []
    for index, stage in enumerate(plan.stages):
        layers = stage.end_layer - stage.first_layer
        per_token = kv_per_layer * layers + (log_row if index < len(plan.stages) - 1 else 0)
        budget = budget_bytes or int(max(0, stage.node.free_bytes - stage.bytes) * kv_fraction)
        affordable.append(num_kv_blocks(budget, block_size, per_token, max_useful_tokens))
    return min(affordable)


@dataclass
class PipelineLayout:
    """A pipeline ready to load: the links and stage servers (stages 1.., in order; spares are
    added later), their profiles (the head's first), the plan and the KV blocks per stage."""

    links: StageLinks
    stages: list[StageHandle]
    profiles: list[NodeProfile]
    plan: PartitionPlan
    num_blocks: int

    @property
    def head_layers(self) -> range:
        return range(self.plan.stages[0].first_layer, self.plan.stages[0].end_layer)

    @classmethod
    def measure(
        cls,
        config: EngineConfig,
        checkpoint: Checkpoint,
        dtype: torch.dtype,
        max_model_len: int,
        probe_timeout_s: float = 120.0,
    ) -> PipelineLayout:
        """Starts local stage processes (or links to config's stage servers), measures this node
        and every stage server, and plans. Local stage processes share this node's profile."""
        addresses = config.stage_servers
        if addresses and len(addresses) != config.pipeline_parallel_size - 1:
            raise ValueError(
                f"{len(addresses)} stage addresses for {config.pipeline_parallel_size - 1} stages after the head"
            )
        links = StageLinks(addresses + config.spare_stage_servers)
        stages = [links.handle(address) for address in addresses] or [
            links.handle() for _ in range(config.pipeline_parallel_size - 1)
        ]
        try:
            head = measure_node(config, checkpoint)
            profiles = [head] + (links.probe(stages, config, probe_timeout_s) if addresses else [head] * len(stages))
            names = ["head"] + [stage.inbox if addresses else f"local stage {i}" for i, stage in enumerate(stages, 1)]
            bytes_per_value = torch.finfo(dtype).bits // 8
            plan = plan_stages(
                checkpoint.config, profiles, names, config.layers_per_stage, bytes_per_value, max_model_len
            )
            wire_bytes = torch.finfo(wire_dtype(config.pipeline_wire_dtype, dtype)).bits // 8
            blocks = pipeline_kv_blocks(
                checkpoint.config,
                plan,
                config.kv_cache_bytes,
                config.kv_cache_fraction,
                config.block_size,
                bytes_per_value,
                wire_bytes,
                config.max_num_seqs * max_model_len,
            )
        except BaseException:
            for stage in stages:
                stage.close()
            links.close()
            raise
        return cls(links, stages, profiles, plan, blocks)

    def describe(self) -> str:
        """The plan, and each node's measured figures."""
        nodes = "\n".join(
            f"  {stage.node.name}: {profile.seconds_per_layer * 1e3:.2f} ms per layer, "
            f"{stage.node.free_bytes / 2**30:.1f} GiB of the {profile.free_bytes / 2**30:.1f} GiB free "
            f"on {profile.host} {profile.device}"
            for stage, profile in zip(self.plan.stages, self.profiles)
        )
        return f"{self.plan.describe()}\nmeasured:\n{nodes}\nKV blocks per stage: {self.num_blocks}"
