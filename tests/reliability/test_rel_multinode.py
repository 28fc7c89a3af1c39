"""Training across Ray nodes: `train.placement` on a three-node Ray cluster built on this machine.

The cluster (`ray.cluster_utils.Cluster`): a head with no CPUs (the driver only, as the KubeRay head is started with
num-cpus 0) and two worker nodes, each with its own custom resource; node `a` has room for both ranks, node `b` for
one. The run attaches to it the way a KubeRay job does, through `RAY_ADDRESS` (`rlpipe.ray_env.ensure_ray`).

What it proves:
- `train.placement=spread` puts the two trainer ranks on two different Ray nodes (asserted from each actor's node
  id), `train.resources` pins bundles to the nodes that offer the resource, and `pack` keeps both on one node;
- the gloo process group, the colocated HF rollout, the DCP checkpoint (one shard file per rank, each written by its
  own node's process) and the metrics are node-independent: 4 iterations on two nodes give the one-node run's
  reproducible metrics bit for bit (the columns of `tests/golden/hf-20.json`, which leave out timings and memory);
- losing a trainer node after a checkpoint (`Cluster.remove_node`, SIGKILL of its raylet and workers) stops the run
  with `RecoverableError` (what Flyte retries), leaves the last checkpoint intact, and a resume on a replacement
  node (what KubeRay does for a lost pod) reproduces the unbroken run's last iterations;
- a group the cluster cannot place is an error naming train.placement and the resources after
  train.placement_timeout_s, not a hang.

What one machine cannot show: every node here shares one disk, one IP and loopback TCP. Real nodes need
`checkpoint.root` and `output_dir` on storage all of them see (the ReadWriteMany PVC of `k8s/base`): each rank writes
its own DCP shard into the checkpoint directory (asserted below), and every rank reads the base model from
`output_dir`; a node-local root would split a checkpoint over nodes. Rollouts and metrics travel through Ray, not
files. Nor can it show a node that vanishes without closing its sockets (power loss, partition): there the surviving
rank waits in its collective up to the process group's 10-minute timeout before the loss surfaces.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from rlpipe.config import load_config
from rlpipe.errors import ConfigError, RecoverableError
from rlpipe.loop import iteration_step, open_session, run_segment, segment_loop
from rlpipe.train import checkpoint as ckpt

from .conftest import fast_overrides

pytestmark = pytest.mark.reliability
EXP = "multinode"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "hf-20.json"
NODE_ARGS = {"object_store_memory": 80 * 1024**2, "include_dashboard": False}


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def cluster():
    """Head (0 CPUs), node a (2 CPUs, node_a: 2, trainer: 1), node b (1 CPU, node_b: 1, trainer: 1); the run attaches
    through RAY_ADDRESS. A Ray the session started before is shut down first and restarted after."""
    import ray
    from ray.cluster_utils import Cluster

    had_ray = ray.is_initialized()
    if had_ray:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"head": 1}, **NODE_ARGS})
    nodes = {
        "a": c.add_node(num_cpus=2, resources={"node_a": 2, "trainer": 1}, **NODE_ARGS),
        "b": c.add_node(num_cpus=1, resources={"node_b": 1, "trainer": 1}, **NODE_ARGS),
    }
    old = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = c.address
    try:
        from rlpipe.ray_env import ensure_ray

        ensure_ray()
        c.wait_for_nodes()
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old
        if had_ray:
            from rlpipe.ray_env import ensure_ray

            ensure_ray()


def _cfg(shared_out: Path, root: Path, **extra):
    ov = {"checkpoint.root": str(root), "experiment": EXP, "train.world_size": 2, "checkpoint.every": 2, **extra}
    return load_config(overrides=fast_overrides(shared_out, **ov))


def _where(worker) -> tuple[str, str]:
    """Runs inside a TrainingWorker actor: its Ray node id and the rlpipe it imported."""
    import ray

    import rlpipe

    return ray.get_runtime_context().get_node_id(), rlpipe.__file__


def _run(cfg, checkpoint: str | None = None, on_iteration=None, k: int = 4) -> tuple[list[dict], list[tuple]]:
    """`run_segment`'s synchronous path, keeping the session to ask its workers where they run."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import the test module
    session = open_session(cfg, checkpoint, _quiet)
    try:
        where = ray.get([w.__ray_call__.remote(_where) for w in session.controller.workers])
        result = segment_loop(session, checkpoint, k, lambda: iteration_step(session, _quiet), on_iteration)
    finally:
        session.close()
    return result.metrics, where


def _reproducible(rows: list[dict]) -> list[dict]:
    """The columns two runs of the same config agree on to the last bit (JSON text: NaN == NaN, 0.0 != -0.0)."""
    columns = json.loads(GOLDEN.read_text())["columns"]
    return [{k: json.dumps(r[k]) for k in columns if k in r} for r in rows]


@pytest.fixture(scope="module")
def one_node(cluster, shared_out, tmp_path_factory):
    """The reference: both ranks packed on node a (train.resources={node_a: 1})."""
    root = tmp_path_factory.mktemp("one-node") / "ckpt"
    rows, where = _run(_cfg(shared_out, root, **{"train.resources": {"node_a": 1}}))
    assert len({node for node, _ in where}) == 1
    return rows


def test_spread_ranks_on_two_nodes_reproduce_the_one_node_run(cluster, shared_out, one_node, tmp_path):
    c, nodes = cluster
    root = tmp_path / "ckpt"
    cfg = _cfg(shared_out, root, **{"train.placement": "spread", "train.resources": {"trainer": 1}})
    rows, where = _run(cfg)
    assert [node for node, _ in where] in ([nodes["a"].node_id, nodes["b"].node_id],
                                           [nodes["b"].node_id, nodes["a"].node_id])  # fmt: skip
    repo = Path(__file__).resolve().parents[2]
    assert all(Path(f).is_relative_to(repo) for _, f in where), where  # this checkout's code on every node
    want = _reproducible(one_node)
    assert len(want) == 4 and {"reward_mean", "loss", "grad_norm", "lr", "tokens"} <= set(want[0])
    assert _reproducible(rows) == want
    shards = sorted(p.name for p in (ckpt.latest_checkpoint(root, EXP) / ckpt.WEIGHTS_DIR).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own file: the root must be shared


def _lose_node(c, node) -> None:
    """The whole node dies at once: its worker processes (children of its raylet, which SIGKILL of the raylet alone
    leaves running and reachable by the driver) and then its Ray processes."""
    import psutil
    from ray._private import ray_constants

    raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    for child in raylet.children(recursive=True):
        child.kill()
    c.remove_node(node, allow_graceful=False)


def test_losing_a_trainer_node_is_recoverable_and_the_resume_matches(cluster, shared_out, one_node, tmp_path):
    c, nodes = cluster
    root = tmp_path / "ckpt"
    cfg = _cfg(shared_out, root, **{"train.placement": "spread", "train.resources": {"trainer": 1}})

    def kill_after_checkpoint(row: dict) -> None:
        if row["iteration"] == 3.0:  # step-000002 is published; iteration 4 finds node b gone
            assert [p.name for p in ckpt.list_checkpoints(root, EXP)] == ["step-000002"]
            _lose_node(c, nodes.pop("b"))

    with pytest.raises(RecoverableError, match="training worker was lost"):
        _run(cfg, on_iteration=kill_after_checkpoint)
    latest = ckpt.latest_checkpoint(root, EXP)
    assert latest is not None and latest.name == "step-000002"
    ckpt.verify_checkpoint(latest)

    nodes["b2"] = c.add_node(num_cpus=1, resources={"node_b": 1, "trainer": 1}, **NODE_ARGS)  # KubeRay's new pod
    c.wait_for_nodes()
    resumed = run_segment(cfg, str(latest), 4, log=_quiet)  # what the Flyte retry does
    assert [r["iteration"] for r in resumed.metrics] == [3.0, 4.0]
    assert _reproducible(resumed.metrics) == _reproducible(one_node)[2:]


def test_an_unplaceable_spread_fails_with_a_message_naming_the_placement(cluster, shared_out, tmp_path):
    import ray

    cfg = _cfg(shared_out, tmp_path / "ckpt", **{"train.placement": "spread", "train.world_size": 4,
                                                 "train.placement_timeout_s": 3})  # fmt: skip

    def live() -> set[str]:
        return {i for i, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}

    before = live()
    with pytest.raises(ConfigError, match=r"train\.placement=spread \(STRICT_SPREAD\).*world_size=4") as err:
        run_segment(cfg, None, 1, log=_quiet)
    assert "train.resources={}" in str(err.value) and "'node_a': 2.0" in str(err.value)
    deadline = time.monotonic() + 30  # removal is asynchronous in the GCS
    while live() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not live() - before  # the pending group was removed, not left to grab resources later


def test_a_driver_without_ray_address_starts_its_own_ray_beside_the_cluster(cluster):
    """`ensure_ray` attaches only when told (RAY_ADDRESS): with the cluster up as the newest Ray on the machine, a
    driver without it starts its own local Ray (plain `ray.init()` would join the cluster)."""
    import subprocess

    c, _ = cluster
    code = (
        "from rlpipe.ray_env import ensure_ray; import ray; ensure_ray(); print(ray.get_runtime_context().gcs_address)"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    own = out.stdout.strip().splitlines()[-1]
    assert own and own != c.address, (own, c.address)
