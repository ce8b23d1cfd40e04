"""Deployment configs are validated up front: each broken one gets a message naming the bad key
and why; the shipped examples are valid."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from shoal.cluster.config import DeploymentConfig, ModelDeployment, describe
from shoal.cluster.launcher_local import worker_command

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

BROKEN = [
    ({"modles": []}, "modles: unknown key"),
    ({"port": 70000}, "port: Input should be less than or equal to 65535"),
    ({"models": [{"model": "x"}]}, "models.0.name: Field required"),
    ({"models": [{"name": "a", "replicas": -1}]}, "models.0.replicas: Input should be greater than or equal to 0"),
    ({"models": [{"name": "a", "kv_cache": "lots"}]}, "models.0.kv_cache: 'lots' is not a size such as 256MiB"),
    ({"models": [{"name": "a", "kv_cache": 1.5}]}, "models.0.kv_cache: a fraction of free memory must be in (0, 1]"),
    ({"models": [{"name": "a", "dtype": "int3"}]}, "models.0.dtype: Input should be 'auto', 'float32'"),
    ({"models": [{"name": "a", "tensor_parallel": 2, "pipeline_parallel": 2}]},
     "models.0: tensor_parallel and pipeline_parallel in one replica are not supported together yet"),
    ({"models": [{"name": "a", "pipeline_parallel": 3, "layers_per_stage": [20, 10]}]},
     "models.0: layers_per_stage needs one count of at least 1 per pipeline stage (3)"),
    ({"models": [{"name": "a", "pipeline_parallel": 3, "stage_servers": ["tcp://b:7100"]}]},
     "models.0: stage_servers needs one address per pipeline stage after the first (2)"),
    ({"models": [{"name": "a", "replicas": 2, "pipeline_parallel": 2, "stage_servers": ["tcp://b:7100"]}]},
     "models.0: stage_servers serve one pipeline replica"),
    ({"models": [{"name": "a", "tensor_parallel": 0}]},
     "models.0.tensor_parallel: Input should be greater than or equal to 1"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "models: a defined more than once"),
    ({"models": [{"name": "a", "fallbacks": ["b"]}]}, "the fallbacks of a must be other models of this deployment; not b"),
    ({"router": {"port": 9000}}, "router: port: set by the deployment"),
    ({"router": {"policy": "fastest"}}, "router.policy: unknown policy 'fastest'"),
    ({"router": {"failover": {"attempts": {"critical": 0, "standard": 1, "sheddable": 1}}}},
     "router.failover.attempts: attempts needs a value of at least 1"),
    ({"router": {"health": {"outliers": {"factor": 0.5}}}}, "router.health.outliers.factor: Input should be greater than 1"),
    ({"models": [{"name": "a", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]},
     "models.0.autoscaling: min_replicas (3) exceeds max_replicas (2)"),
    ({"models": [{"name": "a", "replicas": 5, "autoscaling": {"max_replicas": 4}}]},
     "models.0: replicas (5) must be within autoscaling.min_replicas (1) and max_replicas (4)"),
    ({"models": [{"name": "a", "warm_spares": -1}]}, "models.0.warm_spares: Input should be greater than or equal to 0"),
    ({"launcher": "kubernetes"}, "launcher: Input should be 'local'"),
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


def test_the_default_is_two_workers_of_the_bundled_model_and_fallbacks_reach_the_router():
    default = DeploymentConfig()
    assert [(m.name, m.model, m.replicas) for m in default.models] == [
        ("smollm2-135m-instruct", "smollm2-135m-instruct", 2)]
    config = DeploymentConfig(models=[{"name": "big", "fallbacks": ["small"]}, {"name": "small"}])
    assert config.router_config().models["big"].fallbacks == ["small"]


def test_a_pipeline_replica_is_given_its_stage_servers_and_spares():
    deployment = ModelDeployment(name="a", pipeline_parallel=3, layers_per_stage=[10, 10, 10],
                                 stage_servers=["tcp://b:7100", "tcp://c:7100"], spare_stage_servers=["tcp://d:7100"])
    command = " ".join(worker_command(deployment, "127.0.0.1", 8001))
    assert ("--pipeline-parallel-size 3 --layers-per-stage 10,10,10 --stage tcp://b:7100 --stage tcp://c:7100 "
            "--spare-stage tcp://d:7100") in command
    placed = " ".join(worker_command(ModelDeployment(name="a", pipeline_parallel=2), "127.0.0.1", 8001, ("tcp://e:1",)))
    assert placed.endswith("--pipeline-parallel-size 2 --stage tcp://e:1")
