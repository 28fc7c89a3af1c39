"""Faults with real Ray actors: a worker dying mid-fit, and the driver SIGKILLed while it publishes a checkpoint. One reference run (2 iterations, a checkpoint after each) is shared by every test of the module."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config
from rlpipe.errors import RecoverableError
from rlpipe.loop import iteration_step, run_segment
from rlpipe.session import RLSession
from rlpipe.train import checkpoint as ckpt

from .conftest import fast_overrides

pytestmark = [pytest.mark.reliability, pytest.mark.usefixtures("ray_session")]
EXP = "rel"


def _quiet(_msg: str) -> None:
    pass


def _cfg(shared_out: Path, root: Path, **extra):
    return load_config(overrides=fast_overrides(shared_out, **{"checkpoint.root": str(root), "experiment": EXP,
                                                               "checkpoint.every": 1, **extra}))  # fmt: skip


@pytest.fixture(scope="module")
def reference(shared_out, tmp_path_factory):
    """Uninterrupted run: iterations 1 and 2 in one session, a checkpoint after each."""
    root = tmp_path_factory.mktemp("ref") / "ckpt"
    cfg = _cfg(shared_out, root)
    result = run_segment(cfg, None, 2, log=_quiet)
    found = ckpt.list_checkpoints(root, EXP)
    assert [p.name for p in found] == ["step-000001", "step-000002"] and str(found[-1]) == result.checkpoint
    return {"cfg": cfg, "first": found[0], "last": found[1], "metrics": result.metrics,
            "model_dir": prepare_base_model(cfg, _quiet)}  # fmt: skip


def _shared_out(reference) -> Path:
    return Path(reference["cfg"].output_dir).parent  # fast_overrides puts output_dir at <shared>/out


def _copy_first(reference, root: Path) -> Path:
    dst = root / EXP / reference["first"].name
    shutil.copytree(reference["first"], dst)
    return dst


def _weights(path: Path) -> dict:
    """A DCP checkpoint's tensors (model and optimizer) as a flat dict, through torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / f"{path.name}-flat.pt"
    dcp_to_torch_save(str(path / ckpt.WEIGHTS_DIR), str(out))
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(f"{prefix}/{i}", v)
        else:
            flat[prefix] = node

    walk("", torch.load(out, weights_only=True))
    out.unlink()
    return flat


def _arm_worker_exit(worker) -> None:
    """Runs inside the actor: the next optimizer step (after forward/backward of the fit) kills the process."""
    import os as _os

    worker._clip_and_step = lambda: _os._exit(1)


def test_worker_killed_mid_fit_is_recoverable_and_resume_matches(reference, tmp_path):
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor cannot import the test module
    root = tmp_path / "ckpt"
    first = _copy_first(reference, root)
    cfg = _cfg(_shared_out(reference), root)
    session = RLSession(cfg, reference["model_dir"], str(first), _quiet)
    try:
        ray.get(session.controller.workers[0].__ray_call__.remote(_arm_worker_exit))
        with pytest.raises(RecoverableError, match="training worker was lost"):
            iteration_step(session, _quiet)
    finally:
        session.close()
    latest = ckpt.latest_checkpoint(root, EXP)
    assert latest == first, "the failed iteration must not publish a checkpoint"
    ckpt.verify_checkpoint(latest)

    resumed = run_segment(cfg, str(latest), 1, log=_quiet)  # what the Flyte retry does
    assert resumed.metrics[0]["iteration"] == 2.0
    for key in ("reward_mean", "loss", "grad_norm", "train_entropy"):
        assert resumed.metrics[0][key] == reference["metrics"][1][key], key
    want, got = _weights(reference["last"]), _weights(Path(resumed.checkpoint))
    assert want.keys() == got.keys() and len(want) > 4
    for k, v in want.items():
        assert torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k], k
    a = ckpt.load_train_state(reference["last"])
    b = ckpt.load_train_state(resumed.checkpoint)
    assert (a.counters, a.sampler) == (b.counters, b.sampler)


DRIVER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import rlpipe.train.checkpoint as ck
    from rlpipe import cli

    marker = Path(sys.argv[1])
    real = ck.atomic_write_json

    def write_then_hang(path, obj, *a, **k):
        out = real(path, obj, *a, **k)
        if Path(path).name == "manifest.json":  # the complete manifest is in the temp dir; the rename is next
            marker.write_text(str(Path(path).parent))
            time.sleep(300)
        return out

    ck.atomic_write_json = write_then_hang
    sys.exit(cli.main(sys.argv[2:]))
    """
)


def test_driver_sigkilled_while_publishing_keeps_the_old_checkpoint(reference, tmp_path):
    import ray

    root = tmp_path / "ckpt"
    first = _copy_first(reference, root)
    ov = fast_overrides(_shared_out(reference), **{"checkpoint.root": str(root), "experiment": EXP, "iterations": 2})
    marker = tmp_path / "marker"
    argv = ["run", "--resume"] + [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    log = tmp_path / "driver.log"  # a file, not a pipe: a full pipe would block the driver before the marker
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), *argv], env=env,
                                stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.time() + 150
            while not marker.exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.2)
            assert marker.exists(), f"the driver never reached the manifest write: {log.read_text()[-2000:]}"
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    tmp_dir = Path(marker.read_text())
    assert tmp_dir.name.startswith(".step-000002.tmp-") and tmp_dir.is_dir()
    assert json.loads((tmp_dir / "manifest.json").read_text())["complete"] is True  # looks complete, is not published
    assert ckpt.list_checkpoints(root, EXP) == [first]
    assert ckpt.latest_checkpoint(root, EXP) == first
    ckpt.verify_checkpoint(first)
    assert ckpt.load_train_state(first).counters.iteration == 1
    assert ckpt.remove_stale_temp_dirs(root, EXP, older_than_s=0) == [tmp_dir]
    # Ray reaps the dead driver's actors and placement group, so later tests (and jobs) get the CPUs back
    deadline = time.time() + 60
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources()["CPU"]
