"""A non-finite loss (NaN/Inf advantages, overflowing ones) skips that optimizer step, counts it, and leaves the
weights exactly as if the bad mini-batch had not been there. In-process: the real TrainingWorker.fit, no Ray."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from rlpipe.config import load_config
from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.train.worker import TrainingWorker

from ..conftest import in_process_worker as _worker
from .conftest import fast_overrides

pytestmark = pytest.mark.reliability


def _pack(advantage: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    items = [
        SequenceItem(
            prompt_ids=torch.randint(5, 20, (4,), generator=g).tolist(),
            response_ids=torch.randint(5, 20, (3,), generator=g).tolist(),
            advantage=advantage if row == 1 else 0.5,
            rollout_logprobs=[-1.0, -1.5, -2.0],
            row=row,
        )
        for row in range(3)
    ]
    (pack,) = pack_sequences(items, 64, pad_token_id=0, pad_to_max_length=False)
    return pack


@pytest.fixture(scope="module")
def setup(base_model_dir, tmp_path_factory):
    assert not dist.is_initialized()
    cfg = load_config(
        overrides=fast_overrides(tmp_path_factory.mktemp("nan"), **{"train.lr": 1e-2, "train.warmup_steps": 0})
    )
    # warm-up off: a skipped step still advances the schedule, so with warm-up the good step would get another lr
    return cfg, base_model_dir


def _params(w: TrainingWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in w.policy.named_parameters()}


@pytest.fixture(scope="module")
def expected(setup):
    """Weights after the good mini-batch alone (the reference every bad-step run must reproduce)."""
    cfg, model_dir = setup
    reference = _worker(cfg, model_dir)
    before = _params(reference)
    metrics = reference.fit([_pack(1.0, seed=1)], [1], 1, 10)
    assert metrics.skipped_steps == 0 and math.isfinite(metrics.steps[0].grad_norm)
    after = _params(reference)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the good step did move the weights
    return after


@pytest.mark.parametrize("bad_adv", [float("nan"), float("inf"), 3e38])
@pytest.mark.parametrize("bad_first", [False, True])
def test_non_finite_step_is_skipped_counted_and_harmless(setup, expected, bad_adv, bad_first):
    cfg, model_dir = setup
    good, bad = _pack(1.0, seed=1), _pack(bad_adv, seed=2)
    w = _worker(cfg, model_dir)
    packs = [bad, good] if bad_first else [good, bad]
    metrics = w.fit(packs, [1, 1], 1, 10)
    bad_step = metrics.steps[0 if bad_first else 1]
    assert bad_step.skipped and not math.isfinite(bad_step.grad_norm)
    assert not metrics.steps[1 if bad_first else 0].skipped
    assert metrics.skipped_steps == 1 and w.skipped_steps == 1
    assert metrics.summary()["skipped_steps"] == 1.0
    assert w.optimizer_step == 2  # the schedule still advances
    got = _params(w)
    for k, v in expected.items():
        assert torch.isfinite(got[k]).all(), k
        assert torch.equal(got[k], v), f"{k}: a skipped step changed the weights"


def test_nan_reaching_the_objective_is_caught_by_clip_and_step(setup, monkeypatch):
    """NaN injected at the objective level (the loss itself), not through the data."""
    import rlpipe.train.worker as worker_mod

    cfg, model_dir = setup
    real = worker_mod.rl_microbatch_loss
    monkeypatch.setattr(worker_mod, "rl_microbatch_loss", lambda *a, **k: real(*a, **k) * float("nan"))
    w = _worker(cfg, model_dir)
    before = _params(w)
    metrics = w.fit([_pack(1.0, seed=1)], [1], 1, 10)
    assert metrics.skipped_steps == 1 and metrics.steps[0].skipped
    assert all(torch.equal(before[k], v) for k, v in _params(w).items())
    assert all(p.grad is None for p in w.policy.parameters())  # no stale NaN grads leak into the next step
