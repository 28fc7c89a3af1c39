"""Static security checks over rlpipe/: no remote code by default, safe torch.load, no pickle, JSON state."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

import rlpipe

pytestmark = pytest.mark.reliability

PKG = Path(rlpipe.__file__).parent
REPO = PKG.parent
SOURCES = sorted(PKG.rglob("*.py"))


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), filename=str(path))


def _call_name(node: ast.Call) -> str:
    f = node.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def test_sources_were_found():
    assert len(SOURCES) > 30 and PKG / "train" / "checkpoint.py" in SOURCES


def test_trust_remote_code_is_never_hard_wired_true():
    offenders = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if isinstance(node.value, ast.Constant) and node.value.value is True:
                    offenders.append(f"{path}:{node.value.lineno}")
    assert offenders == []


def test_loaders_and_config_default_to_no_remote_code():
    from rlpipe.config import ModelConfig
    from rlpipe.models import loading

    for fn in (loading.load_model, loading.load_tokenizer, loading.load_model_and_tokenizer):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False, fn.__name__
    assert ModelConfig().trust_remote_code is False


def test_every_torch_load_passes_weights_only_true():
    calls = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in {"torch.load", "th.load"}:
                kw = {k.arg: k.value for k in node.keywords}
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                calls.append((f"{path.relative_to(REPO)}:{node.lineno}", ok))
    assert [where for where, ok in calls if not ok] == []


def test_torch_load_is_not_imported_under_another_name():
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                assert "load" not in {a.name for a in node.names}, path


def test_no_pickle_family_imports():
    banned = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n in banned]
    assert found == []


def test_no_torch_save_or_eval_in_state_paths():
    """State files are written as JSON; weights via DCP/safetensors. No torch.save, eval or exec anywhere."""
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in {"torch.save", "eval", "exec", "pickle.loads"}:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {_call_name(node)}")
    assert found == []


def test_no_flytekit_under_rlpipe():
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(m and m.startswith("flytekit") for m in mods), path


def test_train_and_sampler_state_are_plain_json(tmp_path):
    from rlpipe.data.sampler import EpochSampler
    from rlpipe.train import checkpoint as ckpt
    from rlpipe.train import checkpoint_io as cio

    sampler = EpochSampler(10, 4, seed=3)
    sampler.next_batch()
    state = ckpt.TrainState(counters=ckpt.Counters(step=1, iteration=1), sampler=sampler.state(),
                            rng_states=[cio.capture_rng_state()])  # fmt: skip
    path = ckpt.write_train_state(tmp_path, state)
    raw = json.loads(path.read_text())  # strict JSON: would fail on NaN/bytes/objects
    assert raw["sampler"] == sampler.state_dict()
    assert ckpt.load_train_state(tmp_path) == state


def test_k8s_pods_run_non_root():
    """Light cross-check of tests/k8s: every pod-level securityContext in the raw manifests says runAsNonRoot."""
    import yaml

    seen = 0
    for f in sorted((REPO / "k8s").rglob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            stack = [doc]
            while stack:
                node = stack.pop()
                if isinstance(node, dict):
                    ctx = node.get("securityContext")
                    if isinstance(ctx, dict) and "runAsUser" in ctx:
                        seen += 1
                        assert ctx["runAsUser"] != 0 and ctx.get("runAsNonRoot", True) is not False, f
                    if isinstance(ctx, dict) and "privileged" in ctx:
                        assert ctx["privileged"] is False, f
                    stack.extend(node.values())
                elif isinstance(node, list):
                    stack.extend(node)
    assert seen > 0, "no securityContext with runAsUser found under k8s/"
