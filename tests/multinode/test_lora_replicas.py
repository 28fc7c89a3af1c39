"""LoRA with two managed vLLM CPU replicas on two Ray nodes: every update publishes only the adapter, once, through
the object store; each replica writes its own node-local copy, loads it under the new version's adapter name, and
is probed through it. ~3 min on 2 cores (two LoRA-enabled server starts). Skips without the vLLM venv unless
RLPIPE_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import tiny_overrides, vllm_python_or_skip

VLLM_PYTHON = vllm_python_or_skip()


def test_lora_replicas_load_only_the_adapter_each_verified_every_update(cluster, tmp_path):
    import ray

    from rlpipe.config import load_config
    from rlpipe.loop import iteration_step, open_session

    cfg = load_config(overrides=tiny_overrides(tmp_path, **{
        "rollout.engine": "vllm", "rollout.vllm.python": VLLM_PYTHON, "rollout.vllm.replicas": 2,
        "rollout.vllm.resources": {"engine_node": 1}, "rollout.prompts_per_step": 8, "rollout.n": 4,
        "model.warmup_sft_steps": 60, "model.lora.enabled": True, "model.lora.rank": 8, "model.lora.alpha": 16,
        "train.lr": 5e-3, "iterations": 3}))  # fmt: skip
    session = open_session(cfg, None, log=lambda m: None)
    try:
        pool = session.rollout_source.sync
        rows = [iteration_step(session, log=lambda m: None) for _ in range(3)]
        driver = ray.get_runtime_context().get_node_id()
        assert len({s.engine.where["node_id"] for s in pool.syncs} - {driver}) == 2
        full_bytes = sum(f.stat().st_size for f in Path(session.model_dir).glob("*.safetensors"))
        for t, row in enumerate(rows):
            assert row["engine/replica0/weight_version"] == row["engine/replica1/weight_version"] == float(t), row
            assert row["engine/replica0/probe_max_abs_diff"] < 1e-3 and row["engine/replica1/probe_max_abs_diff"] < 1e-3
            assert row["mismatch/mismatch_k3_kl"] < 1e-3, row["mismatch/mismatch_k3_kl"]
        for row in rows[1:]:  # an update's sync moved the adapter only, to both replicas
            assert 0 < row["engine/sync_bytes"] < 0.5 * 2 * full_bytes, (row["engine/sync_bytes"], full_bytes)
        dirs = [Path(s.engine.served_dir) for s in pool.syncs]
        assert all(d.parent.name == "adapters" and (d / "adapter_config.json").is_file() for d in dirs)
        assert dirs[0].parent != dirs[1].parent  # each replica's own node-local copy
        assert not (Path(cfg.output_dir) / "serving").exists()  # the driver published nothing to disk
        served = {ray.get(s.engine.actor.served_model.remote()) for s in pool.syncs}
        assert served == {f"policy-lora-v{int(rows[-1]['optimizer_step']) - 1:08d}"}, served
    finally:
        session.close()
