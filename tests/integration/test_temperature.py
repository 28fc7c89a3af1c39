"""Sampling temperature reaches the trainer: at T != 1 the rollout logprobs (HF engine) and the trainer's old
logprobs are of the same tempered distribution, so the on-policy mismatch is ~0 (issue 17.5)."""

from __future__ import annotations

import pytest

from rlpipe.config import load_config
from rlpipe.loop import run_segment

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.mark.parametrize("old_logprobs", ["recompute", "auto"])
def test_on_policy_mismatch_is_zero_at_temperature_0_7(tmp_path, old_logprobs):
    """A real 2-iteration run at rollout.temperature=0.7: mismatch KL (mean rollout - old over response tokens) and
    k3 below 1e-4 in both iterations (the second after a weight update and a rollout re-sync). Scoring the old
    logprobs at T = 1 instead gives a mismatch of order 0.1 on the tiny model."""
    cfg = load_config(
        overrides=tiny_overrides(
            tmp_path,
            **{"rollout.temperature": 0.7, "iterations": 2, "segment_size": 2, "train.old_logprobs": old_logprobs},
        )
    )
    result = run_segment(cfg, None, 2, log=lambda *_: None)
    assert len(result.metrics) == 2
    for row in result.metrics:
        assert abs(row["mismatch/mismatch_kl"]) < 1e-4, row["mismatch/mismatch_kl"]
        assert row["mismatch/mismatch_k3_kl"] < 1e-4, row["mismatch/mismatch_k3_kl"]
        assert row["train_entropy"] == pytest.approx(row["rollout_entropy"], abs=1e-4)  # both tempered
