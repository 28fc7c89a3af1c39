"""`rlpipe run` with `train.sp_size=2` (Ray actors, gloo) against `sp_size=1`, and resume across sp sizes.

All runs use two workers, so the colocated rollout (each rank samples its slice of the prompts with its own seed)
draws the same samples; only the training layout differs: dp = 2 x sp = 1 against dp = 1 x sp = 2 (one sp group
splitting every pack). The losses are global means, so the iterations must agree up to float summation order.
Resume: a run checkpointed at sp = 2 continues at sp = 1 and one checkpointed at sp = 1 continues at sp = 2; both
must reproduce the uninterrupted sp = 1 run's second iteration (DCP checkpoints; the sp ranks hold identical
replicated weights and optimizer state; the 1 -> 2 hop also switches to FSDP2 over the flattened dp x sp mesh).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlpipe import cli

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")

NOT_COMPARED = ("time", "_per_s", "memory", "iteration", "efficient_attn_ratio")  # timings; the pack layout (dp)


def _run(root: Path, experiment: str, sp: int, iterations: int, resume: bool = False, fsdp="auto") -> list[dict]:
    ov = tiny_overrides(root, **{"experiment": experiment, "iterations": iterations, "checkpoint.every": 1,
                                 "train.world_size": 2, "train.sp_size": sp, "train.fsdp": fsdp, "rollout.n": 8,
                                 "sft.enabled": True, "sft.global_batch_size": 4, "model.warmup_sft_steps": 60})  # fmt: skip
    metrics = root / f"{experiment}.jsonl"
    argv = ["run", "--metrics", str(metrics), *(["--resume"] if resume else [])]
    assert cli.main(argv + [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _assert_rows_close(got: dict, want: dict, where: str) -> None:
    keys = [k for k in want if not any(s in k for s in NOT_COMPARED)]
    assert {"loss", "reward_mean", "sft/loss"} <= set(keys), sorted(want)
    assert want["loss"] != 0 and 0 < want["reward_mean"] < 1, want  # a learning signal, not a trivially equal 0
    for k in keys:
        assert math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6), f"{where} {k}: {got[k]} != {want[k]}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sp-run")


@pytest.fixture(scope="module")
def straight(root) -> list[dict]:
    """The uninterrupted sp = 1 run (dp = 2), checkpointed after each iteration (one Ray job)."""
    return _run(root, "sp1", 1, 2)


def test_sp2_run_matches_sp1_and_resumes_at_sp1(root, straight):
    """sp = 2 for iteration 1 (equal to sp = 1), then resumed from its checkpoint at sp = 1 (2 -> 1)."""
    first = _run(root, "hop21", 2, 1)
    _assert_rows_close(first[0], straight[0], "sp2 iteration 1")
    rows = _run(root, "hop21", 1, 2, resume=True)
    assert len(rows) == 2
    _assert_rows_close(rows[1], straight[1], "resumed 2 -> 1, iteration 2")


def test_sp1_checkpoint_resumes_at_sp2(root, straight):
    """A checkpoint written at sp = 1 (replicated) continues at sp = 2 with FSDP2 over the flattened dp x sp mesh
    (1 -> 2: DCP loads the full tensors into the mesh's shards) as the sp = 1 run does."""
    _run(root, "hop12", 1, 1)
    rows = _run(root, "hop12", 2, 2, resume=True, fsdp=True)
    _assert_rows_close(rows[1], straight[1], "resumed 1 -> 2, iteration 2")
