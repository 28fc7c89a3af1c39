"""rollout.max_staleness=1 against a real vLLM CPU server (the venv of scripts/setup_vllm.sh): ~3 min on 2 cores.

Skips without the vLLM venv unless RLPIPE_REQUIRE_VLLM=1 (CI), as test_vllm_engine.py does.
"""

from __future__ import annotations

import numpy as np

from tests.conftest import tiny_overrides, vllm_python_or_skip

VLLM_PYTHON = vllm_python_or_skip()


def test_k1_on_vllm_stays_within_staleness_logs_the_gap_and_keeps_learning(tmp_path, ray_session):
    from rlpipe.config import load_config
    from rlpipe.loop import run_segment

    cfg = load_config(overrides=tiny_overrides(tmp_path, **{
        "rollout.engine": "vllm", "rollout.vllm.python": VLLM_PYTHON, "rollout.max_staleness": 1,
        "algo.rollout_is.enabled": True, "model.warmup_sft_steps": 180, "rollout.prompts_per_step": 64,
        "rollout.n": 8, "iterations": 10, "segment_size": 10, "train.world_size": 2}))  # fmt: skip
    rows = run_segment(cfg, None, 10, log=lambda m: None).metrics
    assert [int(r["iteration"]) for r in rows] == list(range(1, 11))
    step_after = {0: 0.0} | {int(r["iteration"]): r["optimizer_step"] for r in rows}
    for r in rows:
        t = int(r["iteration"])
        # the version vLLM served for batch t is the one logged after iteration t-2: one update old at most
        assert r["engine/weight_version"] == step_after[max(0, t - 2)], t
        assert r["staleness"] == min(1, t - 1)
        assert "mismatch/mismatch_k3_kl" in r and "rollout_is/rollout_is_mean" in r
        if t == 1:  # sampled from the weights the trainer holds: on-policy (batch 2 too is from the base weights,
            # but trained after update 1)
            assert r["mismatch/mismatch_k3_kl"] < 1e-3, t
    assert min(r["mismatch/mismatch_k3_kl"] for r in rows[1:]) > 1e-5  # one update old: a real gap, measured
    first, last = np.mean([r["reward_mean"] for r in rows[:3]]), np.mean([r["reward_mean"] for r in rows[-3:]])
    assert last > first - 0.05, (first, last)  # no collapse (10 iterations are too few to demand a rise)
