"""Deployment configs are validated up front: each broken one gets a message naming the bad key
and why; the shipped examples are valid."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from shoal.cluster.config import DeploymentConfig, ModelDeployment, describe
from shoal.cluster.launcher_local import worker_command
from shoal.config.engine import EngineConfig
from shoal.config.speculative import SpeculativeConfig

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

BROKEN = [
    ({"modles": []}, "modles: unknown key"),
    ({"port": 70000}, "port: Input should be less than or equal to 65535"),
    ({"models": [{"model": "x"}]}, "models.0.name: Field required"),
    ({"models": [{"name": "a", "replicas": -1}]}, "models.0.replicas: Input should be greater than or equal to 0"),
    ({"models": [{"name": "a", "kv_cache": "lots"}]}, "models.0.kv_cache: 'lots' is not a size such as 512MiB"),
    (
        {"models": [{"name": "a", "kv_cache": 1.5}]},
        "models.0.kv_cache: 1.5: a fraction of free memory must be in (0, 1]",
    ),
    ({"models": [{"name": "a", "dtype": "int3"}]}, "models.0.dtype: Input should be 'auto', 'float32'"),
    (
        {"models": [{"name": "a", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}]},
        "models.0: tensor_parallel_size and pipeline_parallel_size in one replica are not supported together yet",
    ),
    (
        {"models": [{"name": "a", "pipeline_parallel_size": 3, "layers_per_stage": [20, 10]}]},
        "models.0: layers_per_stage needs one count of at least 1 per pipeline stage (3)",
    ),
    (
        {"models": [{"name": "a", "pipeline_parallel_size": 3, "stage_servers": ["tcp://b:7100"]}]},
        "models.0: stage_servers needs one address per pipeline stage after the first (2)",
    ),
    (
        {"models": [{"name": "a", "replicas": 2, "pipeline_parallel_size": 2, "stage_servers": ["tcp://b:7100"]}]},
        "models.0: stage_servers serve one pipeline replica",
    ),
    (
        {"models": [{"name": "a", "tensor_parallel_size": 0}]},
        "models.0.tensor_parallel_size: Input should be greater than or equal to 1",
    ),
    ({"models": [{"name": "a", "tensor_parallel": 2}]}, "models.0.tensor_parallel: unknown key"),
    ({"models": [{"name": "a", "kv_cache": "1TB"}]}, "models.0.kv_cache: 1TB is more than this host's memory"),
    ({"models": [{"name": "a", "kv_cache": "1048576"}]}, "models.0.kv_cache: '1048576': a fraction of free memory"),
    (
        {"models": [{"name": "a", "max_num_seqs": 0}]},
        "models.0.max_num_seqs: Input should be greater than or equal to 1",
    ),
    ({"models": [{"name": "a", "pipeline_wire_dtype": "int8"}]}, "models.0.pipeline_wire_dtype: Input should be"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "models: a (colocated) defined more than once"),
    ({"models": [{"name": "a", "role": "prefill"}]}, "the prefill workers of a hand their streams to decode"),
    (
        {"models": [{"name": "a", "role": "decode", "fallbacks": ["b"]}, {"name": "a"}, {"name": "b"}]},
        "models: every role of a must have the same fallbacks",
    ),
    ({"models": [{"name": "a", "role": "decode", "warm_spares": 1}]}, "models.0: a decode pool has a fixed size"),
    ({"models": [{"name": "a", "role": "router"}]}, "models.0.role: Input should be 'colocated', 'prefill'"),
    (
        {"models": [{"name": "a", "fallbacks": ["b"]}]},
        "the fallbacks of a must be other models of this deployment; not b",
    ),
    ({"router": {"port": 9000}}, "router: port: set by the deployment"),
    ({"router": {"policy": "fastest"}}, "router.policy: unknown policy 'fastest'"),
    (
        {"router": {"failover": {"attempts": {"critical": 0, "standard": 1, "sheddable": 1}}}},
        "router.failover.attempts: attempts needs a value of at least 1",
    ),
    (
        {"router": {"health": {"outliers": {"factor": 0.5}}}},
        "router.health.outliers.factor: Input should be greater than 1",
    ),
    (
        {"models": [{"name": "a", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]},
        "models.0.autoscaling: min_replicas (3) exceeds max_replicas (2)",
    ),
    (
        {"models": [{"name": "a", "replicas": 5, "autoscaling": {"max_replicas": 4}}]},
        "models.0: replicas (5) must be within autoscaling.min_replicas (1) and max_replicas (4)",
    ),
    (
        {"models": [{"name": "a", "warm_spares": -1}]},
        "models.0.warm_spares: Input should be greater than or equal to 0",
    ),
    ({"launcher": "kubernetes"}, "launcher: Input should be 'local'"),
    (
        {"models": [{"name": "a", "speculative": {"method": "medusa"}}]},
        "models.0.speculative.method: Input should be 'ngram' or 'draft_model'",
    ),
    (
        {"models": [{"name": "a", "speculative": {"method": "ngram", "model": "m"}}]},
        "models.0: a speculative model is given exactly when the method is draft_model",
    ),
    ({"models": [{"name": "a", "speculative": {"k": 4}}]}, "models.0.speculative.k: unknown key"),
    ({"supervisor": {"restart_backoff_s": -1}}, "supervisor.restart_backoff_s: Input should be greater than 0"),
]


@pytest.mark.parametrize(("raw", "message"), BROKEN, ids=[m.split(":")[0] for _, m in BROKEN])
def test_each_broken_config_names_its_key_and_reason(raw, message):
    with pytest.raises(ValidationError) as error:
        DeploymentConfig(**raw)
    assert message in describe(error.value)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_the_examples_are_valid(example):
    config = DeploymentConfig.from_file(example)
    assert config.models and config.router_config().port == config.port


def test_a_model_runs_in_prefill_and_decode_pools_with_its_role_on_each_workers_command_line():
    config = DeploymentConfig.from_file(Path(__file__).parents[2] / "examples" / "disaggregated.yaml")
    assert [m.role for m in config.models] == ["prefill", "decode"]
    assert list(config.router_config().models) == [config.models[0].name]
    for model in config.models:
        command = worker_command(model, "127.0.0.1", 8001)
        assert command[command.index("--role") + 1] == model.role
    assert len({m.log_name(0) for m in config.models}) == 2


def test_the_default_is_two_workers_of_the_bundled_model_and_fallbacks_reach_the_router():
    default = DeploymentConfig()
    assert [(m.name, m.model, m.replicas) for m in default.models] == [
        ("smollm2-135m-instruct", "smollm2-135m-instruct", 2)
    ]
    config = DeploymentConfig(models=[{"name": "big", "fallbacks": ["small"]}, {"name": "small"}])
    assert config.router_config().models["big"].fallbacks == ["small"]


def test_a_pipeline_replica_is_given_its_stage_servers_and_spares():
    deployment = ModelDeployment(
        name="a",
        pipeline_parallel_size=3,
        layers_per_stage=[10, 10, 10],
        stage_servers=["tcp://b:7100", "tcp://c:7100"],
        spare_stage_servers=["tcp://d:7100"],
    )
    config = _shipped_engine_config(worker_command(deployment, "127.0.0.1", 8001))
    assert config.pipeline_parallel_size == 3 and config.layers_per_stage == (10, 10, 10)
    assert config.stage_servers == ("tcp://b:7100", "tcp://c:7100")
    assert config.spare_stage_servers == ("tcp://d:7100",)
    placed = ModelDeployment(name="a", pipeline_parallel_size=2)
    assert _shipped_engine_config(worker_command(placed, "127.0.0.1", 8001, ("tcp://e:1",))).stage_servers == (
        "tcp://e:1",
    )


def _shipped_engine_config(command: list[str]) -> EngineConfig:
    return EngineConfig.from_json(command[command.index("--engine-config") + 1])


@pytest.mark.parametrize(
    ("kv_cache", "expected"),
    [
        (1.0, {"kv_cache_fraction": 1.0, "kv_cache_bytes": None}),
        (0.5, {"kv_cache_fraction": 0.5, "kv_cache_bytes": None}),
        ("2GiB", {"kv_cache_bytes": 2 << 30}),
        (None, {"kv_cache_fraction": 0.1, "kv_cache_bytes": None}),
    ],
)
def test_the_kv_cache_of_a_model_entry_reaches_the_engine_config_as_it_says(kv_cache, expected):
    config = _shipped_engine_config(worker_command(ModelDeployment(name="a", kv_cache=kv_cache), "127.0.0.1", 8001))
    assert {name: getattr(config, name) for name in expected} == expected


def test_every_engine_setting_has_a_deployment_key_of_the_same_name():
    settable = set(ModelDeployment.model_fields)
    left_to_the_worker = {"cache_dir", "kv_cache_bytes", "kv_cache_fraction"}  # kv_cache sets the last two
    assert {f.name for f in dataclasses.fields(EngineConfig)} - settable == left_to_the_worker
    entry = ModelDeployment(
        name="served",
        model="m",
        dtype="float32",
        num_threads=3,
        share_weights=True,
        max_model_len=256,
        max_num_seqs=5,
        tensor_parallel_size=2,
        seed=9,
        itl_target_ms=40,
    )
    config = _shipped_engine_config(worker_command(entry, "127.0.0.1", 8001))
    assert (
        config.model,
        config.dtype,
        config.num_threads,
        config.share_weights,
        config.max_model_len,
        config.max_num_seqs,
        config.tensor_parallel_size,
        config.seed,
        config.itl_target_ms,
    ) == ("m", "float32", 3, True, 256, 5, 2, 9, 40)


def test_the_speculative_section_reaches_the_worker_whole():
    """YAML `speculative: {...}` becomes EngineConfig.speculative, shipped on the worker's command line."""
    entry = ModelDeployment(
        name="served", speculative={"method": "draft_model", "model": "d", "num_speculative_tokens": 3}
    )
    config = _shipped_engine_config(worker_command(entry, "127.0.0.1", 8001))
    assert config.speculative == SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3)
