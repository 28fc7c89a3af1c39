"""rollout.engine=vllm against a real vLLM CPU server (the venv of scripts/setup_vllm.sh).

Each test starts a server (~60-100 s on 2 cores). CI sets RLPIPE_REQUIRE_VLLM=1 so a missing venv fails instead
of skipping.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_overrides, vllm_python_or_skip

VLLM_PYTHON = vllm_python_or_skip()


def _vllm_config(tmp_path, **extra):
    from rlpipe.config import load_config

    overrides = tiny_overrides(
        tmp_path,
        **{
            "rollout.engine": "vllm",
            "rollout.vllm.python": VLLM_PYTHON,
            "model.warmup_sft_steps": 180,  # the default warm start: RL has signal from iteration 1
            "rollout.prompts_per_step": 64,
            "rollout.n": 8,
            **extra,
        },
    )
    return load_config(overrides=overrides)


def _server_pid(lines: list[str]) -> int:
    pids = [int(m.group(1)) for line in lines if (m := re.search(r"vLLM server starting on .*\(pid (\d+)", line))]
    assert pids, f"no server start logged in {lines}"
    return pids[-1]


def test_grpo_on_vllm_is_on_policy_every_iteration_learns_and_survives_a_server_kill(tmp_path, ray_session):
    from rlpipe.loop import run_segment
    from rlpipe.train import checkpoint as ckpt
    from rlpipe.train.lineage import read_manifest

    # 4 optimizer steps per iteration: more learning per rollout, and 4 steps between two rollouts must cost 1 sync
    cfg = _vllm_config(tmp_path, iterations=24, segment_size=24,
                       **{"train.world_size": 2, "checkpoint.every": 8, "train.optimizer_steps": 4})  # fmt: skip
    lines: list[str] = []

    def kill_server_after_iteration_10(row):
        if row["iteration"] == 10:
            os.killpg(_server_pid(lines), signal.SIGKILL)

    result = run_segment(cfg, None, 24, on_iteration=kill_server_after_iteration_10, log=lines.append)
    rows = result.metrics
    assert len(rows) == 24
    prev_step = 0.0
    for row in rows:
        it = int(row["iteration"])
        # the engine served exactly the weights the trainer held before this rollout, verified by the probe ...
        assert row["engine/weight_version"] == prev_step, it
        assert row["engine/probe_max_abs_diff"] < 1e-3, it
        # ... so the samples are on-policy: rollout logprobs equal the trainer's old logprobs
        assert abs(row["mismatch/mismatch_kl"]) < 1e-3, (it, row["mismatch/mismatch_kl"])
        assert row["mismatch/mismatch_k3_kl"] < 1e-3, it
        prev_step = row["optimizer_step"]
    assert [int(r["iteration"]) for r in rows if r["engine/restarts"] > 0] == [11]
    assert [r["optimizer_step"] for r in rows] == [4.0 * i for i in range(1, 25)]
    # one sync per rollout however many optimizer steps came before it; the restart may add one re-sync
    assert all(r["engine/syncs"] == 1 for r in rows if r["engine/restarts"] == 0), [r["engine/syncs"] for r in rows]
    assert sum(r["engine/syncs"] for r in rows) <= 25
    first, last = np.mean([r["reward_mean"] for r in rows[:6]]), np.mean([r["reward_mean"] for r in rows[-6:]])
    assert last > first + 0.03, (first, last)

    saved = ckpt.list_checkpoints(cfg.checkpoint.root, cfg.experiment)
    assert [p.name for p in saved] == ["step-000032", "step-000064", "step-000096"]  # named by optimizer step
    for path in saved:
        ckpt.verify_checkpoint(path)
    served = [s for p in saved for s in read_manifest(p).served]
    assert served[0].iterations == "1-8" and served[0].weight_versions == list(range(0, 32, 4))
    assert all(s.engine.startswith("vllm http://127.0.0.1:") for s in served)
    assert not list(Path(cfg.checkpoint.root, cfg.experiment).glob(".tmp*"))


@pytest.fixture(scope="module")
def external_server(tmp_path_factory):
    """A vLLM server rlpipe did not start (rollout.server_url), on the tiny default base model."""
    from rlpipe.base_model import prepare_base_model
    from rlpipe.rollout.vllm_process import VLLMServer, VLLMServerSpec, cpu_server_args

    tmp = tmp_path_factory.mktemp("ext")
    cfg = _vllm_config(tmp)
    model_dir = prepare_base_model(cfg, log=lambda m: None)
    spec = VLLMServerSpec(python=VLLM_PYTHON, model_dir=model_dir, served_model_name="policy",
                          max_model_len=256, log_path=str(tmp / "vllm.log"), extra_args=cpu_server_args(256))  # fmt: skip
    server = VLLMServer(spec, log=lambda m: None)
    server.start()
    yield tmp, server
    server.stop()


def test_a_batched_probe_scores_like_one_request_per_sequence(external_server):
    """`score_many` (the probe of every sync, one request) against `score` one sequence at a time, same server.
    Runs before the test below, which stops the module's server."""
    from rlpipe.rollout.vllm_engine import VLLMEngine

    _, server = external_server
    engine = VLLMEngine(server.base_url, "policy", eos_token_id=None)
    pairs = [([5, 9, 11], [40, 41, 42, 43]), ([7], [12, 13]), ([100, 3, 60, 61, 62], [80])]
    batched = engine.score_many(pairs)
    one_by_one = [engine.score(prompt, response) for prompt, response in pairs]
    assert [len(b) for b in batched] == [4, 2, 1]
    np.testing.assert_allclose(np.concatenate(batched), np.concatenate(one_by_one), atol=1e-5)
    assert len({round(x, 3) for x in np.concatenate(batched)}) > 1  # real logprobs, not one constant


def test_a_partial_sync_is_detected_and_a_dead_server_fails_cleanly(external_server, ray_session):
    from safetensors.torch import load_file, save_file

    from rlpipe.errors import RolloutServerError, WeightSyncError
    from rlpipe.loop import iteration_step
    from rlpipe.session import RLSession
    from rlpipe.train import checkpoint as ckpt

    tmp, server = external_server
    cfg = _vllm_config(tmp, **{"rollout.server_url": server.base_url, "rollout.prompts_per_step": 8})
    from rlpipe.base_model import prepare_base_model

    session = RLSession(cfg, prepare_base_model(cfg, log=lambda m: None), log=lambda m: None)
    try:
        iteration_step(session)  # a correct sync
        first_ckpt = session.save("segment")
        publish = session.rollout_source.sync.publish

        def publish_without_lm_head(version):
            """What a plain HF export of a tied model gives: no lm_head.weight, so vLLM keeps its old head."""
            path = publish(version)
            weights = Path(path) / "model.safetensors"
            state = load_file(weights)
            del state["lm_head.weight"]
            save_file(state, weights, metadata={"format": "pt"})
            return path

        session.rollout_source.sync.publish = publish_without_lm_head
        with pytest.raises(WeightSyncError, match=r"vllm http://127\.0\.0\.1:\d+ .*version 1: max \|logprob diff"):
            iteration_step(session)

        def publish_truncated(version):
            path = publish(version)
            weights = Path(path) / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
            return path

        session.rollout_source.sync.publish = publish_truncated
        with pytest.raises(RolloutServerError):
            iteration_step(session)

        session.rollout_source.sync.publish = publish
        server.stop()  # the server dies; rlpipe does not own it, so the run must stop with a clear error
        with pytest.raises(RolloutServerError, match=r"127\.0\.0\.1"):
            iteration_step(session)
    finally:
        session.close()
    assert [p.name for p in ckpt.list_checkpoints(cfg.checkpoint.root, cfg.experiment)] == [Path(first_ckpt).name]
    ckpt.verify_checkpoint(first_ckpt)
