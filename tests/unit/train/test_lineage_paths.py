"""Locations written into a manifest resolve from any working directory, even with relative roots."""

import os
from pathlib import Path

from rlpipe.train.run_state import absolute as _absolute


def test_relative_locations_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _absolute("runs/checkpoints/x/step-000001") == os.path.join(str(tmp_path), "runs/checkpoints/x/step-000001")
    assert _absolute("s3://bucket/runs/step-000001") == "s3://bucket/runs/step-000001"


class _SavingController:
    """Stands in for the Ray workers: `save` writes one weights file, as a DCP save would."""

    def __init__(self, cfg, model_dir):
        pass

    def save(self, weights_dir: str) -> list[dict]:
        Path(weights_dir).mkdir(parents=True)
        (Path(weights_dir) / "w.bin").write_bytes(b"\0")
        return [{}]

    def shutdown(self) -> None:
        pass


def test_manifest_base_model_path_is_absolute(tmp_path, monkeypatch):
    """Relative `output_dir` and `checkpoint.root` (the defaults are `runs/...`): the manifest's `base_model.path`
    must still name the model dir when the manifest is read from another working directory (it was stored as
    given, `out/base-models/...`, like `parent` before it was made absolute)."""
    from rlpipe.base_model import prepare_base_model
    from rlpipe.config import load_config
    from rlpipe.session import RLSession
    from rlpipe.train.lineage import model_fingerprint, read_manifest

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("rlpipe.session.TrainingController", _SavingController)
    overrides = {"output_dir": "out", "checkpoint.root": "ckpt", "model.warmup_sft_steps": 0}
    cfg = load_config(overrides=overrides)
    model_dir = prepare_base_model(cfg, log=lambda _m: None)
    assert not os.path.isabs(model_dir)  # what the session is handed
    session = RLSession(cfg, model_dir, log=lambda _m: None)
    saved = session.save("train")
    monkeypatch.chdir(tmp_path / "ckpt")
    manifest = read_manifest(os.path.join(str(tmp_path), saved))
    assert os.path.isabs(manifest.base_model.path)
    assert manifest.base_model.path == str((tmp_path / model_dir).resolve())
    assert manifest.base_model.fingerprint == model_fingerprint(manifest.base_model.path)
