"""Two vLLM CPU replicas on two Ray nodes of a three-node cluster started on this machine (`ray.cluster_utils`):
every replica synced and probed after every update, the weights reaching each node through the object store and
written to that node's own directory, and a replica whose server is killed mid-rollout losing no prompt.

One machine cannot prove network placement, but it proves the rest: the actors land on different Ray nodes (each
node offers one `engine_node` resource), the driver never writes a serving directory (so nothing relies on a shared
filesystem), and each replica loads the directory its own actor wrote. ~5 min on 2 cores (two server starts and
one restart). Skips without the vLLM venv unless RLPIPE_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides, vllm_python_or_skip

VLLM_PYTHON = vllm_python_or_skip()


@pytest.fixture(scope="module")
def session(cluster, tmp_path_factory):
    from rlpipe.config import load_config
    from rlpipe.loop import open_session

    root = tmp_path_factory.mktemp("replicas")
    cfg = load_config(overrides=tiny_overrides(root, **{
        "rollout.engine": "vllm", "rollout.vllm.python": VLLM_PYTHON, "rollout.vllm.replicas": 2,
        "rollout.vllm.resources": {"engine_node": 1}, "rollout.prompts_per_step": 8, "rollout.n": 4,
        "model.warmup_sft_steps": 60, "iterations": 3}))  # fmt: skip
    s = open_session(cfg, None, log=lambda m: None)
    yield s
    s.close()


def test_two_replicas_on_two_nodes_each_synced_and_verified_every_update(session):
    from rlpipe.loop import iteration_step

    pool = session.rollout_source.sync
    nodes = {sync.engine.where["node_id"] for sync in pool.syncs}
    assert len(nodes) == 2 and session_node() not in nodes  # two engine nodes, neither the driver's
    rows = [iteration_step(session, log=lambda m: None) for _ in range(3)]
    for t, row in enumerate(rows):
        served = float(t)  # the version sampled for iteration t+1: the optimizer step after iteration t
        assert row["engine/replica0/weight_version"] == row["engine/replica1/weight_version"] == served, row
        assert row["engine/replica0/probe_max_abs_diff"] < 1e-3 and row["engine/replica1/probe_max_abs_diff"] < 1e-3
        assert row["mismatch/mismatch_k3_kl"] < 1e-3, row["mismatch/mismatch_k3_kl"]
    assert all(r["engine/syncs"] == 1.0 for r in rows[1:])  # one sync per update, every replica in it
    dirs = [Path(sync.engine.served_dir) for sync in pool.syncs]
    assert dirs[0].parent != dirs[1].parent  # each replica loaded the copy its own actor wrote on its node
    assert not (Path(session.cfg.output_dir) / "serving").exists()  # the driver published nothing to disk
    assert {r for _, r, o in pool.dispatch_log if o == "ok"} == {0, 1}  # both sampled
    names = [entry["engine"] for entry in session.run.served]
    assert all("replica 0" in n and "replica 1" in n for n in names)  # the lineage names every replica


def test_a_replica_killed_mid_rollout_loses_no_prompt_and_samples_none_twice(session):
    import ray

    from rlpipe.rollout.engine import SamplingParams

    pool = session.rollout_source.sync
    victim = pool.syncs[0].engine
    pid = ray.get(victim.actor.server_pid.remote())
    prompts = [session.prompts[i % len(session.prompts)].prompt_ids for i in range(128)]
    params = SamplingParams(n=8, max_new_tokens=6, temperature=1.0, seed=11)
    version = session.counters.step
    pool.ensure_current(version)  # synced first, so the kill lands in the rollout, not in a load
    killer = threading.Timer(0.5, os.killpg, (pid, 9))  # the server's process group: API server + engine core
    killer.start()
    start = time.perf_counter()
    gens = pool.generate(prompts, params, version)
    killer.join()
    assert [g.prompt_index for g in gens] == [i for i in range(128) for _ in range(8)]
    ok = [i for i, _, outcome in pool.dispatch_log if outcome == "ok"]
    assert sorted(ok) == list(range(128))  # every prompt answered exactly once
    failed = {i for i, r, o in pool.dispatch_log if o == "failed"}
    assert failed, f"the kill came too late ({time.perf_counter() - start:.1f} s): nothing was in flight"
    assert all(r == 0 for _, r, o in pool.dispatch_log if o == "failed")
    assert failed <= {i for i, r, o in pool.dispatch_log if o == "ok" and r == 1}  # re-sent to the live one
    assert victim.served_version == version and pool.live == [0, 1]  # restarted from its weights, re-verified
    assert pool.stats.restarts >= 1


def session_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
