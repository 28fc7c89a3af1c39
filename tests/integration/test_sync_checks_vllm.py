"""Issue 33 against one real vLLM CPU server (module-scoped: one ~90 s start): each way a load can silently fail
is caught at the first sync after it happens, at the float32 and at the bf16 probe tolerance (applied to this
float32 engine: the CPU cannot serve bf16 reliably). Updates are one AdamW step sized so that the stale engine's
probe difference stays under the tolerance: the absolute check alone would pass every one of these faults.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench.sync_blind_spot import VLLM_PYTHON, Trainer, start_server

if not Path(VLLM_PYTHON).is_file():
    if os.environ.get("RLPIPE_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"RLPIPE_REQUIRE_VLLM=1 but there is no vLLM venv python at {VLLM_PYTHON}")
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: run `bash scripts/setup_vllm.sh`", allow_module_level=True)

# tolerance -> an lr whose one step moves the probe by max ~0.9 x tolerance (measured on the tiny default)
LR = {1e-3: 1e-5, 0.1: 1e-3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rlpipe.models.tiny import create_tiny_model_dir

    tmp = tmp_path_factory.mktemp("sync-checks")
    base = create_tiny_model_dir(tmp / "base")
    srv = start_server(base, str(tmp / "vllm.log"))
    yield base, srv
    srv.stop()


def _sync(server, tmp_path, tolerance: float, check_checksums: bool = True):
    from rlpipe.rollout.engine_sync import EngineSync
    from rlpipe.rollout.vllm_engine import VLLMEngine

    base, srv = server
    trainer = Trainer(base, tmp_path / "serving")
    engine = VLLMEngine(srv.base_url, "policy", None, check_checksums=check_checksums)
    sync = EngineSync(engine, lambda v: trainer.publish(v), trainer.probe_logprobs, trainer.probe, tolerance,
                      log=lambda m: None)  # fmt: skip
    sync.ensure_current(0)  # the first load (the server holds another test's weights: no checksum baseline yet)
    return trainer, engine, sync


def _step_with_fault(monkeypatch, kind: str, trainer: Trainer, lr: float, tmp_path: Path):
    """One update, then make the engine's next load go wrong the way `kind` says (every HTTP call succeeds)."""
    import rlpipe.rollout.vllm_engine as ve

    real = ve.request_json
    old_dir = trainer.publish(version=1000)  # the weights the engine holds now (a copy the pruning keeps)
    trainer.step(lr)

    def doctored(path: str, drop) -> str:
        """A copy of `path` as the engine would read it if it skipped `drop` (tensors keep the old values)."""
        from safetensors.torch import load_file, save_file

        out = tmp_path / f"doctored-{kind}"
        shutil.copytree(path, out, dirs_exist_ok=True)
        new, old = load_file(Path(path) / "model.safetensors"), load_file(Path(old_dir) / "model.safetensors")
        save_file({k: (old[k] if drop(k) else v) for k, v in new.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})  # fmt: skip
        return str(out)

    def faulty(url, body, timeout_s, method="POST"):
        if url.endswith("/collective_rpc") and body.get("method") == "reload_weights":
            path = body["kwargs"]["weights_path"]
            if kind == "load_skipped":
                return {}
            redirect = {
                "wrong_dir": lambda: old_dir,
                "layer_not_loaded": lambda: doctored(path, lambda k: k.startswith("model.layers.1.")),
                "lm_head_not_loaded": lambda: doctored(path, lambda k: k == "lm_head.weight"),
            }.get(kind)
            if redirect is not None:
                body = {**body, "kwargs": {"weights_path": redirect()}}
        if url.endswith("/update_weight_version") and kind == "version_not_advanced":
            return {}
        return real(url, body, timeout_s, method=method)

    monkeypatch.setattr(ve, "request_json", faulty)


@pytest.mark.parametrize("tolerance", [1e-3, 0.1], ids=["fp32-tol", "bf16-tol"])
@pytest.mark.parametrize(
    ("kind", "caught_by"),
    [
        ("load_skipped", r"checksum of \d+ of \d+ updated parameters did not change"),
        ("wrong_dir", r"checksum of \d+ of \d+ updated parameters did not change"),
        ("layer_not_loaded", r"did not change: model\.layers\.1\."),
        # vLLM shares the tied head with the embedding: the stale head overwrote it, so the embedding is what sticks
        ("lm_head_not_loaded", r"did not change: (lm_head|model\.embed_tokens)\.weight"),
        ("version_not_advanced", r"reports weight version '0' after loading version 1"),
    ],
)
def test_each_silent_load_failure_is_caught_at_its_first_sync(
    server, tmp_path, monkeypatch, kind, caught_by, tolerance
):
    from rlpipe.errors import WeightSyncError

    trainer, engine, sync = _sync(server, tmp_path, tolerance)
    _step_with_fault(monkeypatch, kind, trainer, LR[tolerance], tmp_path)
    with pytest.raises(WeightSyncError, match=rf"vllm http://127\.0\.0\.1:\d+ .*{caught_by}"):
        sync.ensure_current(1)
    assert engine.served_version is None  # never trusted without a new, verified load


@pytest.mark.parametrize("tolerance", [1e-3, 0.1], ids=["fp32-tol", "bf16-tol"])
@pytest.mark.parametrize("kind", ["load_skipped", "wrong_dir"])  # a stale head alone: separation stays > 0
def test_the_relative_probe_alone_catches_a_stale_engine_the_absolute_tolerance_passes(
    server, tmp_path, monkeypatch, kind, tolerance
):
    """The blind spot, kept as a test: the stale engine's probe difference is under the tolerance, and the
    relative check (engine-side checksums off) still fails the sync."""
    from rlpipe.errors import WeightSyncError

    trainer, engine, sync = _sync(server, tmp_path, tolerance, check_checksums=False)
    _step_with_fault(monkeypatch, kind, trainer, LR[tolerance], tmp_path)
    with pytest.raises(WeightSyncError, match=r"still serves .*version 0's weights after syncing version 1"):
        sync.ensure_current(1)
    assert sync.stats.probe_max_abs_diff < tolerance  # what the absolute check alone would have accepted
    assert sync.stats.probe_separation < 0 and sync.stats.probe_inconclusive == 0.0


@pytest.mark.parametrize("tolerance", [1e-3, 0.1], ids=["fp32-tol", "bf16-tol"])
def test_correct_syncs_pass_every_check_and_report_their_cost(server, tmp_path, tolerance):
    trainer, engine, sync = _sync(server, tmp_path, tolerance)
    for v in (1, 2):
        trainer.step(LR[tolerance])
        sync.stats = type(sync.stats)()
        sync.ensure_current(v)
        row = sync.stats.row(v)
        assert engine.reported_version() == str(v) and row["engine/probe_max_abs_diff"] < 1e-4
        assert row["engine/probe_separation"] == pytest.approx(1.0, abs=0.05) and row["engine/probe_inconclusive"] == 0
        assert row["engine/checksum_params_moved"] > 0 and row["engine/checksum_params_stuck"] == 0
        assert 0 < row["engine/check_time_s"] < row["engine/sync_time_s"]
