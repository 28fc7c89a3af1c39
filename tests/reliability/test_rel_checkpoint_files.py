"""Checkpoint files on disk: foreign, tampered, pickled, half-written and unwritable cases (no Ray needed)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from rlpipe.errors import CheckpointError
from rlpipe.train import checkpoint as ckpt
from rlpipe.train.lineage import MANIFEST_NAME, model_fingerprint

pytestmark = pytest.mark.reliability


def test_the_fixture_checkpoint_is_valid(fake_checkpoint, base_model_dir):
    manifest = ckpt.verify_checkpoint(fake_checkpoint, expect_model_fingerprint=model_fingerprint(base_model_dir))
    assert manifest.complete and manifest.step == 3
    assert ckpt.latest_checkpoint(fake_checkpoint.parent.parent, "exp") == fake_checkpoint


def test_checkpoint_from_another_model_is_refused(fake_checkpoint, base_model_dir, tmp_path):
    cfg = json.loads((Path(base_model_dir) / "config.json").read_text())
    foreign = model_fingerprint({**cfg, "hidden_size": cfg["hidden_size"] * 2})
    assert foreign != model_fingerprint(base_model_dir)
    with pytest.raises(CheckpointError, match="was written for model"):
        ckpt.verify_checkpoint(fake_checkpoint, expect_model_fingerprint=foreign)
    # dtype / attention backend are not part of the fingerprint: a bf16 run may resume an fp32 checkpoint
    assert model_fingerprint({**cfg, "torch_dtype": "bfloat16"}) == model_fingerprint(base_model_dir)


@pytest.mark.parametrize("rel", [ckpt.TRAIN_STATE_NAME, "config.json", "weights/.metadata"])
def test_tampered_file_fails_its_checksum(fake_checkpoint, rel):
    f = fake_checkpoint / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{rel}.*sha256"):
        ckpt.verify_checkpoint(fake_checkpoint)


def test_deleted_or_added_weight_files_are_refused(fake_checkpoint):
    shard = next(p for p in (fake_checkpoint / "weights").iterdir() if p.suffix == ".distcp")
    extra = fake_checkpoint / "weights" / "evil.distcp"
    shutil.copy(shard, extra)
    with pytest.raises(CheckpointError, match="unlisted"):
        ckpt.verify_checkpoint(fake_checkpoint)
    extra.unlink()
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.verify_checkpoint(fake_checkpoint)


def test_manifest_listing_an_escaping_path_is_refused(fake_checkpoint):
    m = json.loads((fake_checkpoint / MANIFEST_NAME).read_text())
    m["files"]["../../etc/passwd"] = "0" * 64
    (fake_checkpoint / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="unsafe path"):
        ckpt.verify_checkpoint(fake_checkpoint)


class _Boom:
    def __reduce__(self):
        return (print, ("pickle payload executed",))


def test_a_pickle_in_the_state_file_is_never_unpickled(fake_checkpoint, capsys):
    (fake_checkpoint / ckpt.TRAIN_STATE_NAME).write_bytes(pickle.dumps({"step": 3, "x": _Boom()}))
    with pytest.raises(CheckpointError, match="not JSON.*pickle"):
        ckpt.load_train_state(fake_checkpoint)
    assert "payload executed" not in capsys.readouterr().out
    with pytest.raises(CheckpointError):  # and the checksum catches the swap first when verifying
        ckpt.verify_checkpoint(fake_checkpoint)


def test_state_with_unknown_fields_is_refused(fake_checkpoint):
    state = json.loads((fake_checkpoint / ckpt.TRAIN_STATE_NAME).read_text())
    state["surprise"] = 1
    (fake_checkpoint / ckpt.TRAIN_STATE_NAME).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="schema"):
        ckpt.load_train_state(fake_checkpoint)


def test_half_written_checkpoints_are_never_latest(fake_checkpoint):
    """Every state a crash can leave: temp dir (even with a complete-looking manifest), an old-swap dir, a step dir
    without manifest, with a truncated one, with complete=false, and one whose name disagrees with its step."""
    exp = fake_checkpoint.parent
    good_manifest = (fake_checkpoint / MANIFEST_NAME).read_text()

    def fake_step(name: str, manifest: str | None) -> None:
        shutil.copytree(fake_checkpoint, exp / name)
        if manifest is None:
            (exp / name / MANIFEST_NAME).unlink()
        else:
            (exp / name / MANIFEST_NAME).write_text(manifest)

    m = json.loads(good_manifest)
    fake_step(".step-000009.tmp-" + "a" * 32, good_manifest.replace('"step": 3', '"step": 9'))
    fake_step(".step-000010.old-" + "b" * 32, good_manifest)
    fake_step("step-000011", None)
    fake_step("step-000012", good_manifest[: len(good_manifest) // 2])
    fake_step("step-000013", json.dumps({**m, "step": 13, "complete": False}))
    fake_step("step-000014", good_manifest)  # manifest says step 3
    assert ckpt.list_checkpoints(exp.parent, "exp") == [fake_checkpoint]
    assert ckpt.latest_checkpoint(exp.parent, "exp") == fake_checkpoint
    removed = ckpt.remove_stale_temp_dirs(exp.parent, "exp", older_than_s=0)
    assert sorted(p.name[:13] for p in removed) == [".step-000009.", ".step-000010."]
    assert ckpt.verify_checkpoint(fake_checkpoint).step == 3


def test_unwritable_checkpoint_root_fails_cleanly_and_keeps_the_old_checkpoint(fake_checkpoint, tmp_path):
    """The test runs as root, so chmod cannot make a directory unwritable; a regular file in the path can."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    with pytest.raises(OSError):
        ckpt.begin_checkpoint(blocker / "sub", "exp", 4)
    # a failure after begin (disk full, permission) aborts the temp dir and leaves the old checkpoint alone
    tmp = ckpt.begin_checkpoint(fake_checkpoint.parent.parent, "exp", 4)
    ckpt.abort_checkpoint(tmp)
    assert not tmp.exists()
    with pytest.raises(CheckpointError):
        ckpt.abort_checkpoint(fake_checkpoint)  # refuses to delete a real checkpoint
    assert ckpt.latest_checkpoint(fake_checkpoint.parent.parent, "exp") == fake_checkpoint
    ckpt.verify_checkpoint(fake_checkpoint)


def test_unwritable_output_dir_through_the_cli(shared_out, tmp_path, capsys):
    """`rlpipe run` with an output_dir it cannot create: non-zero exit, the problem named, no checkpoint."""
    from rlpipe import cli

    from .conftest import fast_overrides

    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    ov = fast_overrides(shared_out, **{"checkpoint.root": str(tmp_path / "ckpt"), "output_dir": str(blocker / "o")})
    argv = ["run"] + [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    rc = cli.main(argv)  # before the fix in cli.main, NotADirectoryError escaped as a traceback (exit 1)
    err = capsys.readouterr().err
    assert rc == 2 and str(blocker) in err
    assert not (tmp_path / "ckpt").exists()


class _FakeController:
    """Stands in for the Ray workers: records whether the session released them."""

    made: list[_FakeController] = []

    def __init__(self, cfg, model_dir):
        self.closed = False
        _FakeController.made.append(self)

    def load(self, weights_dir, worker_states):
        raise AssertionError("a tampered checkpoint must be refused before its weights are loaded")

    def shutdown(self):
        self.closed = True


def _resume_tampered(fake_checkpoint, shared_out, monkeypatch):
    from rlpipe.config import load_config
    from rlpipe.session import RLSession

    from .conftest import fast_overrides

    monkeypatch.setattr("rlpipe.session.TrainingController", _FakeController)
    _FakeController.made.clear()
    state = fake_checkpoint / ckpt.TRAIN_STATE_NAME
    state.write_text(state.read_text().replace('"step"', '"step" '))
    cfg = load_config(overrides=fast_overrides(shared_out))
    return RLSession, cfg


def test_resume_from_a_tampered_checkpoint_raises(fake_checkpoint, shared_out, base_model_dir, monkeypatch):
    session_cls, cfg = _resume_tampered(fake_checkpoint, shared_out, monkeypatch)
    with pytest.raises(CheckpointError, match="sha256"):
        session_cls(cfg, base_model_dir, str(fake_checkpoint), log=lambda _m: None)


def test_failed_resume_releases_the_workers(fake_checkpoint, shared_out, base_model_dir, monkeypatch):
    """With real Ray the leaked actors keep their placement group (CPUs) until the driver exits."""
    session_cls, cfg = _resume_tampered(fake_checkpoint, shared_out, monkeypatch)
    with pytest.raises(CheckpointError):
        session_cls(cfg, base_model_dir, str(fake_checkpoint), log=lambda _m: None)
    # The checkpoint is verified before any worker starts; a controller that was started must have been shut down.
    assert all(c.closed for c in _FakeController.made), "a session that failed to open left its workers running"
    assert _FakeController.made == []
