"""The Ray launcher on a local multi-node Ray cluster (ray.cluster_utils): workers land on the nodes
that have the resources they ask for; when a node goes away its worker is started again on another
node that has them, and the router keeps serving throughout."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from ray import cluster_utils

from tests.support.serving import busy, healthy_workers, supervised
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def ray_cluster():
    """A head without the `accel` resource and two nodes with one each. The list of those nodes is
    the module's: a test that replaces one leaves the list saying so."""
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2, resources={"accel": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()


def test_workers_are_placed_by_resources_and_rescheduled_when_their_node_goes(deploy, ray_cluster):
    cluster, nodes = ray_cluster
    node_a, node_b = nodes
    _, url, state_dir, _ = deploy(
        replicas=2,
        resources={"cpus": 1, "custom": {"accel": 1}},
        top={"launcher": "ray", "ray_address": cluster.address},
    )
    assert {s["node"] for s in supervised(state_dir)} == {node_a.node_id, node_b.node_id}
    lost = next(s for s in supervised(state_dir) if s["node"] == node_a.node_id)
    node_c = cluster.add_node(num_cpus=2, resources={"accel": 1})
    cluster.wait_for_nodes()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with busy(client, clients=2, max_tokens=16) as answers:
        cluster.remove_node(node_a)
        nodes[:] = [node_b, node_c]
        moved = wait_for(
            lambda: [
                s
                for s in supervised(state_dir)
                if s["slot"] == lost["slot"] and s["node"] == node_c.node_id and s["state"] == "serving"
            ],
            timeout_s=120,
        )[0]
    assert moved["restarts"] == 1 and moved["url"] in healthy_workers(state_dir)
    assert answers and set(answers) == {16}, [a for a in answers if a != 16][:3]


def test_a_pipeline_replica_has_its_stages_placed_on_other_nodes(deploy, ray_cluster, monkeypatch):
    """Each process of the replica asks for one `accel` and each node has one: the stage lands on
    the other node, the head measures it and plans, and the replica serves as one worker. The
    instruction-set cap set where `shoal serve` runs holds on the node the worker lands on, whose
    raylet was started without it."""
    cluster, nodes = ray_cluster
    monkeypatch.setenv("SHOAL_CPU_ISA", "avx2")
    _, url, state_dir, _ = deploy(
        replicas=1,
        pipeline_parallel_size=2,
        resources={"cpus": 1, "custom": {"accel": 1}},
        top={"launcher": "ray", "ray_address": cluster.address},
    )
    [replica] = supervised(state_dir)
    assert {replica["node"], *replica["stage_nodes"]} == {node.node_id for node in nodes}
    assert len(replica["stage_nodes"]) == 1
    log = Path(replica["log"]).read_text()
    assert "pipeline plan" in log and "ms per layer" in log
    assert "CPU instruction set: avx2 (capped by SHOAL_CPU_ISA" in log
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with busy(client, clients=2, max_tokens=16) as answers:
        wait_for(lambda: len(answers) >= 4, timeout_s=120)
    assert set(answers) == {16}
