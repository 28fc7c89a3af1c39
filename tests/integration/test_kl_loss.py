"""KL to the reference model end to end (`algo.use_kl_loss`): the reference is built from the base model, its
logprobs score the batch, the KL metric and loss are logged and trained on, and a resumed run equals a straight one
(metrics and weights), over 1 and 2 workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config
from rlpipe.data.packing import SequenceItem
from rlpipe.loop import run_segment
from rlpipe.session import RLSession

from ..conftest import tiny_overrides
from .test_rollout_copy_and_export import hf_logprobs

pytestmark = pytest.mark.usefixtures("ray_session")

KL_COEF = 0.5
TIMING = ("time", "per_s", "peak_memory")


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory) -> Path:
    """One output_dir, so the warm-started base model (a reward signal, hence a policy that moves) is built once."""
    return tmp_path_factory.mktemp("kl-out")


def _cfg(root: Path, out: Path, world_size: int, steps: int):
    extra = {"output_dir": str(out), "iterations": 2, "train.world_size": world_size, "train.optimizer_steps": steps,
             "algo.use_kl_loss": True, "algo.kl_coef": KL_COEF, "checkpoint.save_hf": True,
             "model.warmup_sft_steps": 180}  # fmt: skip
    return load_config(overrides=tiny_overrides(root, **extra))


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{ckpt}/hf/model.safetensors")


@pytest.mark.parametrize(("world_size", "steps"), [(1, 1), (2, 2)], ids=["1-worker", "2-workers-2-steps"])
def test_kl_loss_trains_and_resumes_exactly(tmp_path, shared_out, world_size, steps):
    straight_cfg = _cfg(tmp_path / "a", shared_out, world_size, steps)
    straight = run_segment(straight_cfg, None, 2)
    resumed_cfg = _cfg(tmp_path / "b", shared_out, world_size, steps)
    first = run_segment(resumed_cfg, None, 1)
    second = run_segment(resumed_cfg, first.checkpoint, 1)
    rows, resumed_rows = straight.metrics, first.metrics + second.metrics
    assert len(rows) == len(resumed_rows) == 2
    for ra, rb in zip(rows, resumed_rows, strict=True):
        keys = {k for k in ra if not any(t in k for t in TIMING)}
        assert keys == {k for k in rb if not any(t in k for t in TIMING)}
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), k
    # The KL metric (old vs reference) is 0 before the first update and positive after; the KL loss is trained on.
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[1]["kl"] > 0
    assert rows[1]["kl_loss"] > 0
    for row in rows:
        assert row["loss"] == pytest.approx(row["policy_loss"] + KL_COEF * row["kl_loss"], rel=1e-5, abs=1e-9)
    a, b = _weights(straight.checkpoint), _weights(second.checkpoint)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Reference logprobs are the base model's; old logprobs are the trained policy's (which moved away from it).
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(prepare_base_model(resumed_cfg), dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(f"{second.checkpoint}/hf", dtype=torch.float32)
    session = RLSession(resumed_cfg, prepare_base_model(resumed_cfg), second.checkpoint)
    try:
        batch = session.compute_logprobs(session.rollout()[0])
    finally:
        session.close()
    moved = 0.0
    for row in batch.head(4).itertuples():
        item = SequenceItem(prompt_ids=list(row.prompt_ids), response_ids=list(row.response_ids))
        ref, old = torch.tensor(row.ref_logprobs), torch.tensor(row.old_logprobs)
        torch.testing.assert_close(ref, hf_logprobs(base, item), rtol=0, atol=1e-5)
        torch.testing.assert_close(old, hf_logprobs(policy, item), rtol=0, atol=1e-5)
        moved = max(moved, float((ref - old).abs().max()))
    assert moved > 1e-4
