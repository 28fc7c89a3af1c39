"""`train.old_logprobs=auto` (old logprobs taken from the training forward when the old policy is the current one)
must train exactly like `recompute` (a separate no-grad forward first): same loss, grad norm, metrics, weights."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.data.packing import pack_sequences
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from tests.conftest import in_process_worker, random_items, tiny_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("old-lp") / "tiny"
    create_tiny_model_dir(path, TinyModelConfig(), seed=0)
    return str(path)


def _packs():
    items = random_items(3, 8, (1, 6))
    return pack_sequences(items, 32, pad_token_id=0, pad_to_max_length=False)


def _fit(tmp_path, model_dir, mode: str, steps: list[int], **extra):
    cfg = load_config(overrides=tiny_overrides(tmp_path / mode, **{"train.old_logprobs": mode, **extra}))
    worker = in_process_worker(cfg, model_dir)
    packs = _packs()
    metrics = worker.fit(packs, steps or [len(packs)], 1, 10)
    weights = {k: v.detach().clone() for k, v in worker.policy.named_parameters()}
    return metrics, weights


def test_auto_equals_recompute_on_one_step(tmp_path, model_dir):
    auto, w_auto = _fit(tmp_path, model_dir, "auto", [])
    rec, w_rec = _fit(tmp_path, model_dir, "recompute", [])
    assert auto.logprob_time_s < rec.logprob_time_s  # the separate forward really was skipped
    a, r = auto.summary(), rec.summary()
    for key in ("loss", "grad_norm", "train_entropy", "rollout_entropy", "ratio_mean", "tokens"):
        assert a[key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key
    assert a["ratio_max"] == 1.0 and a["ratio_min"] == 1.0  # on-policy: the ratio is exactly one
    assert any(k.startswith("mismatch/") for k in a) and a.keys() == r.keys()
    for name in w_auto:
        torch.testing.assert_close(w_auto[name], w_rec[name], atol=1e-6, rtol=1e-5, msg=name)


def test_auto_recomputes_when_old_policy_differs(tmp_path, model_dir):
    """Two mini-batches (the second sees updated weights) or rollout IS: the separate forward is needed."""
    packs = len(_packs())
    two_steps, _ = _fit(tmp_path, model_dir, "auto", [packs // 2, packs - packs // 2])
    with_is, _ = _fit(tmp_path / "is", model_dir, "auto", [], **{"algo.rollout_is.enabled": True})
    for m in (two_steps, with_is):
        assert m.logprob_time_s > 0.0
    assert two_steps.summary()["ratio_max"] != 1.0  # the second step's ratio moved off one
