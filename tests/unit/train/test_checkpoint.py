"""Checkpoint directories: atomic publish (incl. SIGKILL), verification, JSON-only state, RNG and DCP round trips."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from rlpipe.errors import CheckpointError
from rlpipe.train import checkpoint as ck
from rlpipe.train import checkpoint_io as cio
from rlpipe.train.lineage import (
    BaseModelRef,
    Manifest,
    build_manifest,
    model_architecture,
    model_fingerprint,
    read_manifest,
)

EXP = "exp"
MODEL_CFG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64, "hidden_size": 16}
FP = model_fingerprint(MODEL_CFG)
REPO = Path(__file__).resolve().parents[3]


def manifest_for(step: int, parent: str | None = None, fingerprint: str | None = FP) -> Manifest:
    return build_manifest(
        experiment=EXP,
        step=step,
        iteration=step,
        parent=parent,
        base_model=BaseModelRef(path="/models/tiny", fingerprint=fingerprint),
        config={"lr": 1e-3},
    )


def make_ckpt(root: Path, step: int, payload: bytes = b"weights", **kw) -> Path:
    """A checkpoint with fake DCP files (real DCP is covered by the DCP tests)."""
    tmp = ck.begin_checkpoint(root, EXP, step)
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"meta")
    (tmp / "weights" / "__0_0.distcp").write_bytes(payload)
    ck.write_train_state(tmp, ck.TrainState(step=step, iteration=step))
    ck.write_config(tmp, {"lr": 1e-3})
    return ck.finalize_checkpoint(tmp, manifest_for(step, **kw))


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in (root / EXP).iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------------------ publish / list


def test_begin_finalize_layout_and_checksums(tmp_path):
    tmp = ck.begin_checkpoint(tmp_path, EXP, 42)
    assert tmp.parent == tmp_path / EXP and tmp.name.startswith(".step-000042.tmp-")
    assert ck.latest_checkpoint(tmp_path, EXP) is None  # a temp dir never counts
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"m")
    ck.write_train_state(tmp, ck.TrainState(step=42, iteration=42))  # must agree with the manifest
    final = ck.finalize_checkpoint(tmp, manifest_for(42))
    assert final == tmp_path / EXP / "step-000042" and not tmp.exists()
    m = read_manifest(final)
    assert m.complete and m.step == 42
    naive = {
        p.relative_to(final).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in final.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert m.files == naive and set(naive) == {"weights/.metadata", "train_state.json"}
    assert ck.verify_checkpoint(final).step == 42


def test_manifest_step_must_match_temp_dir(tmp_path):
    tmp = ck.begin_checkpoint(tmp_path, EXP, 5)
    with pytest.raises(CheckpointError, match="step 6"):
        ck.finalize_checkpoint(tmp, manifest_for(6))


def test_latest_and_list_ignore_tmp_incomplete_and_junk(tmp_path):
    for s in (1, 10, 2):
        make_ckpt(tmp_path, s)
    d = tmp_path / EXP
    (d / "step-000099").mkdir()  # no manifest
    (d / "step-000098").mkdir()
    (d / "step-000098" / "manifest.json").write_text("{not json")
    inc = d / "step-000097"
    inc.mkdir()
    m = manifest_for(97).model_dump(mode="json")  # complete: false
    (inc / "manifest.json").write_text(json.dumps(m))
    lie = d / "step-000096"  # manifest for another step
    lie.mkdir()
    (lie / "manifest.json").write_text(json.dumps({**manifest_for(3).model_dump(mode="json"), "complete": True}))
    ck.begin_checkpoint(tmp_path, EXP, 200)  # a writer in progress
    (d / "notes.txt").write_text("x")
    assert [p.name for p in ck.list_checkpoints(tmp_path, EXP)] == ["step-000001", "step-000002", "step-000010"]
    assert ck.latest_checkpoint(tmp_path, EXP) == d / "step-000010"
    assert ck.latest_checkpoint(d) == d / "step-000010"  # root = experiment dir
    assert ck.latest_checkpoint(tmp_path, "nope") is None


def test_existing_step_error_or_replace(tmp_path):
    first = make_ckpt(tmp_path, 3, payload=b"old")
    with pytest.raises(CheckpointError, match="already exists"):
        make_ckpt(tmp_path, 3, payload=b"new")
    assert (first / "weights" / "__0_0.distcp").read_bytes() == b"old"
    ck.verify_checkpoint(first)
    for t in (tmp_path / EXP).glob(".step-*"):
        ck.abort_checkpoint(t)
    tmp = ck.begin_checkpoint(tmp_path, EXP, 3)
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"meta")
    (tmp / "weights" / "__0_0.distcp").write_bytes(b"new")
    ck.write_train_state(tmp, ck.TrainState(step=3, iteration=3))
    final = ck.finalize_checkpoint(tmp, manifest_for(3), exists="replace")
    assert (final / "weights" / "__0_0.distcp").read_bytes() == b"new"
    ck.verify_checkpoint(final)
    assert hidden(tmp_path) == []  # old copy and temp dir are gone


def test_abort_refuses_real_checkpoints(tmp_path):
    final = make_ckpt(tmp_path, 1)
    with pytest.raises(CheckpointError, match="not a checkpoint temp dir"):
        ck.abort_checkpoint(final)
    assert final.exists()
    tmp = ck.begin_checkpoint(tmp_path, EXP, 2)
    ck.abort_checkpoint(tmp)
    assert not tmp.exists()


@pytest.mark.parametrize("fail_on", ["dir", "any"])
def test_replace_failure_mid_finalize_publishes_nothing(tmp_path, monkeypatch, fail_on):
    prev = make_ckpt(tmp_path, 1)
    tmp = ck.begin_checkpoint(tmp_path, EXP, 2)
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"meta")
    ck.write_train_state(tmp, ck.TrainState(step=2, iteration=2))
    real = os.replace

    def flaky(src, dst):
        if fail_on == "any" or Path(src).is_dir():
            raise OSError("injected rename failure")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="injected"):
        ck.finalize_checkpoint(tmp, manifest_for(2))
    monkeypatch.setattr(os, "replace", real)
    assert not (tmp_path / EXP / "step-000002").exists()
    assert ck.latest_checkpoint(tmp_path, EXP) == prev
    ck.verify_checkpoint(prev)
    assert tmp.exists()  # left for inspection; abort cleans it
    ck.abort_checkpoint(tmp)
    assert hidden(tmp_path) == []


def test_remove_stale_temp_dirs_age_guard(tmp_path):
    make_ckpt(tmp_path, 1)
    tmp = ck.begin_checkpoint(tmp_path, EXP, 2)
    assert ck.remove_stale_temp_dirs(tmp_path, EXP, older_than_s=3600) == []
    assert ck.remove_stale_temp_dirs(tmp_path, EXP, older_than_s=0) == [tmp]
    assert not tmp.exists() and (tmp_path / EXP / "step-000001").exists()


# ------------------------------------------------------------------------------------------------ SIGKILL


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from rlpipe.train import checkpoint as ck
    from rlpipe.train.lineage import BaseModelRef, build_manifest
    root, mode = Path(sys.argv[1]), sys.argv[2]
    tmp = ck.begin_checkpoint(root, "exp", 2)
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"meta")
    ck.write_train_state(tmp, ck.TrainState(step=2, iteration=2))
    chunk = os.urandom(1 << 20)
    with open(tmp / "weights" / "__0_0.distcp", "wb") as f:
        for i in range(48):
            f.write(chunk)
            f.flush()
            if mode == "write":
                if i == 4:
                    print("writing", flush=True)
                time.sleep(0.05)
    real = os.replace
    def slow_replace(src, dst):
        if Path(src).is_dir():
            print("renaming", flush=True)
            time.sleep(30)
        return real(src, dst)
    if mode == "rename":
        os.replace = slow_replace
    m = build_manifest(experiment="exp", step=2, iteration=2, base_model=BaseModelRef(path="/m", fingerprint="f"))
    ck.finalize_checkpoint(tmp, m)
    print("done", flush=True)
    """
)


@pytest.mark.parametrize("mode", ["write", "rename"])
def test_sigkill_while_writing_keeps_previous_checkpoint(tmp_path, mode):
    prev = make_ckpt(tmp_path, 1)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline().strip()
        assert line == ("writing" if mode == "write" else "renaming")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / EXP / "step-000002").exists()
    assert ck.latest_checkpoint(tmp_path, EXP) == prev
    ck.verify_checkpoint(prev, FP)
    (stale,) = [p for p in (tmp_path / EXP).iterdir() if p.name.startswith(".step-000002.tmp-")]
    if mode == "rename":  # fully written, manifest says complete, but the name is hidden: still not counted
        assert read_manifest(stale).complete
    assert ck.remove_stale_temp_dirs(tmp_path, EXP, older_than_s=0) == [stale]


# ------------------------------------------------------------------------------------------------ verification


def test_tampered_missing_and_unlisted_files_are_named(tmp_path):
    final = make_ckpt(tmp_path, 1)
    ck.verify_checkpoint(final, FP)
    shard = final / "weights" / "__0_0.distcp"
    shard.write_bytes(b"weightz")
    with pytest.raises(CheckpointError, match=r"weights/__0_0\.distcp does not match its sha256"):
        ck.verify_checkpoint(final)
    shard.write_bytes(b"weights")
    ck.verify_checkpoint(final)
    (final / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json listed in the manifest is missing"):
        ck.verify_checkpoint(final)


def test_unlisted_weights_file_and_incomplete_manifest(tmp_path):
    final = make_ckpt(tmp_path, 1)
    (final / "weights" / "__1_0.distcp").write_bytes(b"extra")
    with pytest.raises(CheckpointError, match=r"unlisted file\(s\) in weights/: weights/__1_0\.distcp"):
        ck.verify_checkpoint(final)
    (final / "weights" / "__1_0.distcp").unlink()
    m = json.loads((final / "manifest.json").read_text())
    (final / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(CheckpointError, match="incomplete"):
        ck.verify_checkpoint(final)
    (final / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest"):
        ck.verify_checkpoint(final)
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.verify_checkpoint(tmp_path / "nowhere")


def test_unsafe_manifest_paths_are_rejected(tmp_path):
    final = make_ckpt(tmp_path, 1)
    m = json.loads((final / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = "0" * 64
    (final / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="unsafe path"):
        ck.verify_checkpoint(final)


def test_required_files(tmp_path):
    tmp = ck.begin_checkpoint(tmp_path, EXP, 1)
    (tmp / "config.json").write_text("{}")
    final = ck.finalize_checkpoint(tmp, manifest_for(1))
    with pytest.raises(CheckpointError, match="lacks required file train_state.json"):
        ck.verify_checkpoint(final)
    assert ck.verify_checkpoint(final, required=()).step == 1


def test_wrong_model_fingerprint(tmp_path):
    final = make_ckpt(tmp_path, 1)
    other = model_fingerprint({**MODEL_CFG, "hidden_size": 32})
    with pytest.raises(CheckpointError) as ei:
        ck.verify_checkpoint(final, other, expect_model_name="/models/bigger")
    msg = str(ei.value)
    assert "was written for model /models/tiny" in msg and "this run uses /models/bigger" in msg
    assert FP[:12] in msg and other[:12] in msg
    unknown = make_ckpt(tmp_path, 2, fingerprint=None)
    with pytest.raises(CheckpointError, match="fingerprint none"):
        ck.verify_checkpoint(unknown, FP)


def test_wrong_model_shape_names_the_manifest_and_the_differing_fields(tmp_path):
    """With the architecture recorded in the manifest, the error says which config field differs, and how."""
    tmp = ck.begin_checkpoint(tmp_path, EXP, 3)
    (tmp / "weights").mkdir()
    (tmp / "weights" / ".metadata").write_bytes(b"meta")
    ck.write_train_state(tmp, ck.TrainState(step=3, iteration=3))
    manifest = manifest_for(3).model_copy(
        update={
            "base_model": BaseModelRef(path="/models/tiny", fingerprint=FP, architecture=model_architecture(MODEL_CFG))
        }
    )
    final = ck.finalize_checkpoint(tmp, manifest)
    bigger = {**MODEL_CFG, "hidden_size": 32, "num_hidden_layers": 4}
    with pytest.raises(CheckpointError) as ei:
        ck.verify_checkpoint(final, model_fingerprint(bigger), expect_architecture=model_architecture(bigger))
    msg = str(ei.value)
    assert f"checkpoint {final} (manifest.json)" in msg
    assert msg.endswith("hidden_size: 16 in the checkpoint, 32 here; num_hidden_layers: null in the checkpoint, 4 here")
    assert ck.verify_checkpoint(final, FP, expect_architecture=model_architecture(MODEL_CFG)).step == 3


# ------------------------------------------------------------------------------------------------ train state


def test_train_state_roundtrip_and_schema(tmp_path):
    from rlpipe.data.sampler import SamplerState

    st = ck.TrainState(
        counters=ck.Counters(step=7, iteration=2, consumed_prompts=64, consumed_tokens=4096, sft_steps=1),
        sampler=SamplerState(epoch=1, seed=3, num_examples=10),
        worker_states=[{"optimizer_step": 7}],
        extra={"lr_scheduler": {"last_epoch": 7}},
    )
    ck.write_train_state(tmp_path, st)
    assert ck.load_train_state(tmp_path) == st
    assert ck.load_train_state(tmp_path / "train_state.json") == st
    assert json.loads((tmp_path / "train_state.json").read_text())["format"] == 2
    (tmp_path / "train_state.json").write_text(json.dumps({"format": 2, "counters": {"step": 1}, "surprise": 1}))
    with pytest.raises(CheckpointError, match="TrainState schema"):
        ck.load_train_state(tmp_path)
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 1, "iteration": 0, "surprise": 1}))
    with pytest.raises(CheckpointError, match="TrainState schema"):
        ck.load_train_state(tmp_path)  # format 1 is migrated, and still checked field by field


def test_format_1_train_state_maps_onto_the_counters(tmp_path):
    """A train_state.json as rlpipe wrote it before the counters were unified (flat step / consumed_samples,
    sampler_state, sft_loader_state, extra.sft_steps) reads back as the same position in format 2."""
    old = {"step": 9, "iteration": 4, "epoch": 1, "consumed_samples": 256, "consumed_tokens": 1000,
           "sampler_state": {"epoch": 1, "consumed_in_epoch": 56, "total_consumed": 256, "seed": 0, "num_examples": 200},
           "sft_loader_state": None, "rng_states": [], "worker_states": [{"optimizer_step": 9}],
           "extra": {"sft_steps": 1, "pending_rollouts": []}}  # fmt: skip
    (tmp_path / "train_state.json").write_text(json.dumps(old))
    st = ck.load_train_state(tmp_path)
    assert st.counters == ck.Counters(iteration=4, step=9, consumed_prompts=256, consumed_tokens=1000, sft_steps=1)
    assert (st.sampler.consumed_in_epoch, st.sampler.total_consumed, st.sft_sampler) == (56, 256, None)
    assert st.extra == {"pending_rollouts": []} and st.worker_states == [{"optimizer_step": 9}]

    with pytest.raises(CheckpointError, match="not found"):
        ck.load_train_state(tmp_path / "nope.json")


def test_pickle_and_torch_save_state_files_are_refused(tmp_path):
    f = tmp_path / "train_state.json"
    f.write_bytes(pickle.dumps({"step": 1, "iteration": 0}))
    with pytest.raises(CheckpointError, match="is not JSON .it looks like a pickle.; rlpipe never unpickles"):
        ck.load_train_state(tmp_path)
    torch.save({"step": 1}, f)
    with pytest.raises(CheckpointError, match="torch.save zip.; rlpipe never unpickles state files"):
        ck.load_train_state(f)
    f.write_text("step = 1")
    with pytest.raises(CheckpointError, match="is not JSON; rlpipe never unpickles"):
        ck.load_train_state(f)


# ------------------------------------------------------------------------------------------------ RNG


def _draw() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4).tolist()


def test_rng_capture_restore_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.randn()
    state = json.loads(json.dumps(cio.capture_rng_state()))
    expected = _draw()
    _draw()
    cio.restore_rng_state(state)
    assert _draw() == expected
    before = cio.capture_rng_state()
    with pytest.raises(CheckpointError, match="invalid RNG state"):
        cio.restore_rng_state({**state, "numpy": ["MT19937", [1, 2], 0, 0, 0.0]})
    with pytest.raises(CheckpointError, match="torch state"):
        cio.restore_rng_state({**state, "torch": "AAAA"})
    with pytest.raises(CheckpointError, match="invalid RNG state"):
        cio.restore_rng_state({**state, "python": [3, [1, 2, 3], None]})
    assert cio.capture_rng_state() == before  # failed restores changed nothing
    with pytest.raises(CheckpointError, match="unknown RNG state format"):
        cio.restore_rng_state({**state, "format": 99})
    _draw()
    cio.restore_rng_state(ck.TrainState(rng_states=[state]).rng_states[0])  # as a resume reads it back
    assert _draw() == expected


# ------------------------------------------------------------------------------------------------ DCP


def _tiny():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(model, opt):
    params = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
    optim = {
        (pid, key): _full(val).detach().clone() if torch.is_tensor(val) else val
        for pid, s in opt.state_dict()["state"].items()
        for key, val in s.items()
    }
    return params, optim


def _assert_same(a, b):
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys() and a[1]
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for k in a[1]:
        assert torch.equal(torch.as_tensor(a[1][k]), torch.as_tensor(b[1][k])), k


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_dcp_plain_model_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    cio.save_dcp(model, opt, tmp_path / "w")
    saved = _snapshot(model, opt)
    _train_step(model, opt, 1)  # perturbs params and Adam moments
    assert not torch.equal(saved[0]["0.weight"], model.state_dict()["0.weight"])
    cio.load_dcp(model, opt, tmp_path / "w")
    _assert_same(saved, _snapshot(model, opt))
    fresh = _tiny()  # weights-only load into a fresh module (rollout side)
    cio.load_dcp(fresh, None, tmp_path / "w")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[0][k])
    with pytest.raises(CheckpointError, match="missing .metadata"):
        cio.load_dcp(fresh, None, tmp_path / "nothing")


def test_the_driver_refuses_a_checkpoint_whose_shards_it_cannot_see(tmp_path):
    """What a node-local checkpoint.root looks like from the driver: shard files (or all of them) on other nodes."""
    model = _tiny()
    cio.save_dcp(model, torch.optim.AdamW(model.parameters()), tmp_path / "w")
    cio.check_dcp_visible(tmp_path / "w")  # a shared root: every file .metadata names is there
    shard = next((tmp_path / "w").glob("*.distcp"))
    shard.unlink()  # written by a rank on another node, onto that node's disk
    with pytest.raises(CheckpointError, match=rf"lack \['{shard.name}'\].*checkpoint\.root must be storage"):
        cio.check_dcp_visible(tmp_path / "w")
    with pytest.raises(CheckpointError, match=r"missing \.metadata.*checkpoint\.root must be storage"):
        cio.check_dcp_visible(tmp_path / "elsewhere")  # rank 0 (the DCP coordinator) on another node


@pytest.fixture
def gloo_world1(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dcp_fsdp2_world1_save_load(tmp_path, gloo_world1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = _tiny()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    assert type(next(model.parameters())).__name__ == "DTensor"

    cio.save_dcp(model, opt, tmp_path / "w")
    saved = _snapshot(model, opt)
    _train_step(model, opt, 1)
    cio.load_dcp(model, opt, tmp_path / "w")
    _assert_same(saved, _snapshot(model, opt))
