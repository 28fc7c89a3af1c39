"""Fixtures of the multi-node tests: a Ray cluster of three nodes started on this machine (`ray.cluster_utils`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    """Head (driver + trainer) and two engine nodes, each with one `engine_node` resource."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # a local Ray of earlier tests
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(2):
        c.add_node(num_cpus=1, resources={"engine_node": 1})
    c.wait_for_nodes()
    monkeypatch_module.setenv("RAY_ADDRESS", c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
