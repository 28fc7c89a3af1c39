"""Resume on another world size, and a new stage from a checkpoint's weights, as real short pipeline runs (Ray).

One run hops 2 workers (replicated, `train.fsdp=auto`) -> 1 -> 2 (FSDP2-sharded), one iteration per segment; an
uninterrupted 1-worker run is the reference. The samplers live in the driver and the LR schedule is a function of
the optimizer step, so the hop must draw the same prompts and SFT examples and use the same LRs. Rewards and losses
differ: the colocated rollout seeds each rank's slice of the prompts (`seed * 1000 + rank`), so bitwise equal runs
are promised only at the same world size (tests/integration/test_training_parity.py::test_resume_parity_with_sft).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import TrainConfig, load_config
from rlpipe.data.sampler import EpochSampler
from rlpipe.loop import iteration_step, run_segment
from rlpipe.session import RLSession
from rlpipe.train import checkpoint as ckpt
from rlpipe.train.checkpoint import Counters
from rlpipe.train.lineage import lineage_chain, read_manifest

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")


def _cfg(root: Path, experiment: str, world_size: int, fsdp: bool | str = "auto", **extra):
    overrides = {"experiment": experiment, "iterations": 3, "train.world_size": world_size, "train.fsdp": fsdp,
                 "sft.enabled": True, "sft.global_batch_size": 4, **extra}  # fmt: skip
    return load_config(overrides=tiny_overrides(root, **overrides))


def _quiet(_msg: str) -> None:
    pass


class _Draws(list):
    """Every batch a EpochSampler draws in the driver, as (sampler seed, indices): the prompt sampler has seed
    data.seed=0, the SFT sampler train.seed + 1 = 1."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = EpochSampler.next_batch

        def recording(sampler: EpochSampler) -> list[int]:
            batch = original(sampler)
            self.append((sampler.seed, [int(i) for i in batch]))
            return batch

        monkeypatch.setattr(EpochSampler, "next_batch", recording)


def _dcp_state(weights_dir: Path, tmp: Path) -> dict:
    """The full (unsharded) model and optimizer state of a DCP checkpoint, whatever world size wrote it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{weights_dir.parent.name}-{weights_dir.parent.parent.name}.pt"
    dcp_to_torch_save(weights_dir, out)
    return torch.load(out, weights_only=True)


def _digest(model_state: dict) -> str:
    """`TrainingWorker.weights_digest` of a model state dict (HF names, sorted)."""
    digest = hashlib.sha256()
    for name, tensor in sorted((k.removeprefix("hf."), v) for k, v in model_state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 1-worker run and the 2 -> 1 -> 2 hop, with what their samplers drew."""
    root = tmp_path_factory.mktemp("resume-world-size")
    prepare_base_model(_cfg(root, "straight", 1))  # its warm-up SFT draws batches too: build it before recording
    straight_draws, hop_draws, logs = _Draws(), _Draws(), []
    with pytest.MonkeyPatch.context() as mp:
        straight_draws.install(mp)
        straight = run_segment(_cfg(root, "straight", 1), None, 3, log=_quiet)
    with pytest.MonkeyPatch.context() as mp:
        hop_draws.install(mp)
        a = run_segment(_cfg(root, "hop", 2), None, 1, log=_quiet)  # 2 workers, replicated
        b = run_segment(_cfg(root, "hop", 1), a.checkpoint, 1, log=logs.append)  # 2 -> 1
        c = run_segment(_cfg(root, "hop", 2, fsdp=True), b.checkpoint, 1, log=logs.append)  # 1 -> 2, sharded
    return {"root": root, "straight": straight, "hop": [a, b, c], "straight_draws": straight_draws,
            "hop_draws": hop_draws, "logs": logs}  # fmt: skip


def test_resume_2_to_1_to_2_draws_the_same_data_and_continues_counters_and_lr(runs):
    straight, hop = runs["straight"], runs["hop"]
    assert len(runs["straight_draws"]) == 6  # 3 iterations x (prompts, SFT)
    assert runs["hop_draws"] == runs["straight_draws"]  # the same prompts and SFT examples, in the same order
    rows = [row for seg in hop for row in seg.metrics]
    assert [r["iteration"] for r in rows] == [1.0, 2.0, 3.0]
    assert [r["optimizer_step"] for r in rows] == [r["optimizer_step"] for r in straight.metrics] == [2.0, 4.0, 6.0]
    for want, got in zip(straight.metrics, rows, strict=True):  # warm-up LR (10 steps): a function of the step
        assert got["lr"] == want["lr"] and got["sft/lr"] == want["sft/lr"]
    assert rows[-1]["lr"] == pytest.approx(TrainConfig().lr * 5 / 10)  # RL step 4 (0-based) of iteration 3

    want, got = ckpt.load_train_state(straight.checkpoint), ckpt.load_train_state(hop[-1].checkpoint)
    for field in ("sampler", "sft_sampler", "extra"):
        assert getattr(got, field) == getattr(want, field), field
    tokens = {"consumed_tokens"}  # padding to a multiple of the dp size differs between world sizes
    assert got.counters.model_dump(exclude=tokens) == want.counters.model_dump(exclude=tokens)
    assert [len(ckpt.load_train_state(s.checkpoint).worker_states) for s in hop] == [2, 1, 2]
    assert {w["optimizer_step"] for w in got.worker_states} == {6}
    reseeded = [m for m in runs["logs"] if "RNG is re-seeded" in m]
    assert len(reseeded) == 2 and "(written by 2 workers) on 1" in reseeded[0] and "by 1 workers) on 2" in reseeded[1]
    chain = lineage_chain(hop[-1].checkpoint)
    assert [m.iteration for m in chain] == [3, 2, 1] and not any(m.parent_weights_only for m in chain)


def test_init_from_starts_a_new_stage_from_the_weights_only(runs, monkeypatch, tmp_path):
    """Weights of a 2-worker sharded checkpoint (step 6) on 1 worker; fresh optimizer, counters, samplers, LR."""
    source = runs["hop"][-1].checkpoint
    cfg = _cfg(runs["root"], "stage-2", 1, **{"checkpoint.init_from": source})
    draws = _Draws()
    draws.install(monkeypatch)
    session = RLSession(cfg, prepare_base_model(cfg), None, log=_quiet)
    try:
        assert session.controller.weights_digest() == _digest(_dcp_state(Path(source) / "weights", tmp_path)["model"])
        assert session.counters == Counters()
        row = iteration_step(session)
        path = session.save("segment", row)
    finally:
        session.close()
    assert draws == runs["straight_draws"][:2]  # a fresh prompt sampler and SFT sampler
    first = runs["straight"].metrics[0]
    assert (row["iteration"], row["optimizer_step"]) == (1.0, 2.0)
    assert row["lr"] == first["lr"] and row["sft/lr"] == first["sft/lr"]  # the schedule restarts at step 0

    state = ckpt.load_train_state(path)
    assert (state.counters.step, state.counters.iteration, state.counters.consumed_prompts) == (2, 1, 4)
    optim = _dcp_state(Path(path) / "weights", tmp_path)["optim"]["state"]
    assert {float(entry["step"]) for entry in optim.values()} == {2.0}  # a fresh AdamW (1 RL + 1 SFT step), not 6 + 2
    manifest = read_manifest(path)
    assert manifest.parent == str(Path(source).resolve()) and manifest.parent_weights_only
    assert manifest.experiment == "stage-2" and manifest.base_model.architecture["hidden_size"] == 64
    assert [m.experiment for m in lineage_chain(path)] == ["stage-2", "hop", "hop", "hop"]
