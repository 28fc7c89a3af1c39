"""rollout.max_staleness=1 through the real session and Ray workers, with an in-process engine that serves the
published weights (the serving dirs the vLLM server would reload): staleness from the logged versions, the gap the
mismatch metrics see, and kill-and-resume parity."""

from __future__ import annotations

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.loop import run_segment

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")


class InProcessEngine:
    """A `SyncableEngine` in the driver: loads each published serving dir, samples with rlpipe's HF engine."""

    restartable = False

    def __init__(self, eos_token_id: int, pad_token_id: int):
        self.name = "inproc"
        self.eos, self.pad = eos_token_id, pad_token_id
        self.served_version: int | None = None
        self.served_dir: str | None = None
        self.model = None
        self.busy = False  # inside generate: a load then would change weights in the middle of a batch
        self.loads: list[int] = []

    def load_weights(self, serving_dir, version):
        from rlpipe.models.loading import load_model

        assert not self.busy, "weights loaded while a batch was being sampled"
        self.model = load_model(serving_dir)
        self.served_version, self.served_dir = version, str(serving_dir)
        self.loads.append(version)

    def generate(self, prompts, params):
        from rlpipe.rollout.hf_engine import HFRolloutEngine

        self.busy = True
        try:
            return HFRolloutEngine(self.model, self.pad, self.eos).generate(prompts, params)
        finally:
            self.busy = False

    @torch.no_grad()
    def score(self, prompt_ids, response_ids):
        ids = torch.tensor([list(prompt_ids) + list(response_ids)])
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        start = len(prompt_ids)
        return [float(logp[start - 1 + j, tok]) for j, tok in enumerate(response_ids)]

    def alive(self):
        return True

    def close(self):
        pass


@pytest.fixture
def inproc_engine(monkeypatch):
    engines: list[InProcessEngine] = []

    def build(cfg, model_dir, name, eos_token_id, log):
        from rlpipe.models.loading import load_tokenizer

        engines.append(InProcessEngine(eos_token_id, load_tokenizer(model_dir).pad_token_id))
        return engines[-1]

    monkeypatch.setattr("rlpipe.rollout.sources._managed_vllm_engine", build)
    torch.set_num_threads(1)
    return engines


def _cfg(root, **extra):
    return load_config(overrides=tiny_overrides(root, **{
        "output_dir": str(root.parent / "out"),  # one base model for both runs ...
        "rollout.weight_sync.dir": str(root / "serving"),  # ... but their own published weights
        "model.warmup_sft_steps": 180,  # the default warm start: rewards (and so updates) from iteration 1
        "iterations": 6, "rollout.engine": "vllm", "rollout.max_staleness": 1, "algo.rollout_is.enabled": True,
        "rollout.prompts_per_step": 8, "rollout.n": 4, **extra}))  # fmt: skip


class Killed(Exception):
    pass


def _straight(root):
    result = run_segment(_cfg(root), None, 6)
    return result.metrics, result.checkpoint


def _killed_and_resumed(root):
    """Checkpoint every 3 iterations; the task dies after iteration 4 (batch 5 in flight); a retry resumes from the
    newest checkpoint, which holds batch 4, sampled before the checkpoint from the weights after iteration 2."""
    from rlpipe.train.checkpoint import latest_checkpoint, load_train_state

    cfg = _cfg(root, **{"checkpoint.every": 3})
    rows: list[dict] = []

    def die_after_4(row):
        rows.append(row)
        if row["iteration"] == 4:
            raise Killed

    with pytest.raises(Killed):
        run_segment(cfg, None, 6, on_iteration=die_after_4)
    resume = latest_checkpoint(cfg.checkpoint.root, cfg.experiment)
    assert resume is not None and load_train_state(resume).counters.iteration == 3
    assert [e["iteration"] for e in load_train_state(resume).extra["pending_rollouts"]] == [4]
    result = run_segment(cfg, str(resume), 6)
    return rows[:3] + result.metrics, result.checkpoint


TIMING = ("time", "per_s", "peak_memory", "wait_s")
SYNC_MECHANICS = ("engine/syncs", "engine/probe_max_abs_diff")  # where syncs happen differs at a segment boundary


def test_k1_staleness_from_logged_versions_mismatch_and_resume_parity(tmp_path, inproc_engine):
    straight, ckpt_a = _straight(tmp_path / "a")
    resumed, ckpt_b = _killed_and_resumed(tmp_path / "b")
    assert [int(r["iteration"]) for r in straight] == [1, 2, 3, 4, 5, 6]

    # staleness, from the logged versions only: batch t was sampled from the weights logged after iteration t-2
    step_after = {0: 0.0} | {int(r["iteration"]): r["optimizer_step"] for r in straight}
    for r in straight:
        t = int(r["iteration"])
        sampled_after = max(0, t - 2)
        assert r["engine/weight_version"] == step_after[sampled_after], t
        assert (t - 1) - sampled_after <= 1 and r["staleness"] == (t - 1) - sampled_after
    # iterations 1 and 2 both sample the base weights; from 3 on the batch is one update old: the engine's
    # logprobs are measurably off the trainer's recomputed old logprobs (iteration 1 is on-policy: ~0)
    assert abs(straight[0]["mismatch/mismatch_kl"]) < 1e-4
    assert all(abs(r["mismatch/mismatch_kl"]) > 1e-5 for r in straight[2:])
    assert any(k.startswith("rollout_is/") for k in straight[-1]), sorted(straight[-1])

    # kill-and-resume parity: same prompts, batches, counters and metrics as the uninterrupted run
    assert len(resumed) == 6
    for ra, rb in zip(straight, resumed, strict=True):
        keys = {k for k in ra if not any(t in k for t in TIMING) and k not in SYNC_MECHANICS}
        assert keys == {k for k in rb if not any(t in k for t in TIMING) and k not in SYNC_MECHANICS}
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-7), (int(ra["iteration"]), k)
    from rlpipe.train.checkpoint import load_train_state

    for ck in (ckpt_a, ckpt_b):  # the run's end: nothing sampled beyond `iterations`
        state = load_train_state(ck)
        assert (
            state.counters.iteration == 6
            and state.counters.consumed_prompts == 6 * 8
            and state.extra["pending_rollouts"] == []
        )
    assert load_train_state(ckpt_a).sampler == load_train_state(ckpt_b).sampler
