"""Manifests and lineage chains: schema, fingerprints, parent walking (relative, file://, missing, cycles), output."""

from __future__ import annotations

import json
import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

import rlpipe
from rlpipe.errors import CheckpointError
from rlpipe.io import stable_hash
from rlpipe.train import checkpoint as ck
from rlpipe.train import lineage as lin

EXP = "exp"
CFG = {"algo": "grpo", "lr": 1e-6}
SHA = "ab" * 32


def make(root: Path, step: int, parent: str | None, data_sha: str = SHA) -> Path:
    tmp = ck.begin_checkpoint(root, EXP, step)
    ck.write_train_state(tmp, ck.TrainState(step=step, iteration=step))
    m = lin.build_manifest(
        experiment=EXP,
        step=step,
        iteration=step,
        parent=parent,
        base_model={"path": "/models/tiny", "fingerprint": "cd" * 32},
        data=[{"name": f"rollout-{step}", "path": f"/data/r{step}.parquet", "sha256": data_sha}],
        config=CFG,
        metrics={"reward_mean": 0.25 * step},
        phase="train",
    )
    return ck.finalize_checkpoint(tmp, m)


def three(root: Path, relative: bool = False) -> list[Path]:
    a = make(root, 1, None)
    b = make(root, 2, "../step-000001" if relative else str(a))
    c = make(root, 3, "../step-000002" if relative else str(b))
    return [a, b, c]


def test_manifest_schema_forbids_extras_and_documents_fields():
    m = lin.build_manifest(experiment="e", step=0, iteration=0, base_model={"path": "/m"})
    with pytest.raises(ValidationError):
        lin.Manifest.model_validate({**m.model_dump(), "surprise": 1})
    with pytest.raises(ValidationError):
        lin.Manifest.model_validate({**m.model_dump(), "step": -1})
    for model in (lin.Manifest, lin.BaseModelRef, lin.DataRef, lin.CodeVersion):
        assert all(f.description for f in model.model_fields.values()), model.__name__


def test_build_manifest_fills_hash_code_version_and_time():
    m = lin.build_manifest(
        experiment="e", step=4, iteration=2, base_model={"path": "/m"}, config=CFG, parent=Path("/p")
    )
    assert m.config_hash == stable_hash(CFG) and m.parent == "/p"
    assert m.code_version.rlpipe == rlpipe.__version__
    assert m.code_version.git_commit is None or re.fullmatch(r"[0-9a-f]{40}", m.code_version.git_commit)
    created = datetime.fromisoformat(m.created_at)
    assert created.utcoffset() == UTC.utcoffset(None)
    assert abs((datetime.now(UTC) - created).total_seconds()) < 60
    assert m.files == {} and m.complete is False
    assert lin.build_manifest(experiment="e", step=0, iteration=0, base_model={"path": "/m"}).config_hash is None


def test_model_fingerprint_ignores_irrelevant_keys(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
           "num_hidden_layers": 2, "torch_dtype": "float32"}  # fmt: skip
    fp = lin.model_fingerprint(cfg)
    assert fp == lin.model_fingerprint({**cfg, "torch_dtype": "bfloat16", "attn_implementation": "sdpa"})
    for key, value in [("hidden_size", 64), ("vocab_size", 101), ("num_hidden_layers", 3), ("model_type", "qwen2")]:
        assert lin.model_fingerprint({**cfg, key: value}) != fp, key
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert lin.model_fingerprint(tmp_path) == fp == lin.model_fingerprint(tmp_path / "config.json")

    class FakeHFConfig:
        def to_dict(self):
            return dict(cfg)

    assert lin.model_fingerprint(FakeHFConfig()) == fp
    with pytest.raises(CheckpointError):
        lin.model_fingerprint(42)


def test_read_manifest_dir_file_and_errors(tmp_path):
    a = make(tmp_path, 1, None)
    assert lin.read_manifest(a) == lin.read_manifest(a / "manifest.json") == lin.read_manifest(f"file://{a}")
    with pytest.raises(CheckpointError, match="no manifest"):
        lin.read_manifest(tmp_path / "nothing")
    (a / "manifest.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        lin.read_manifest(a)
    (a / "manifest.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(CheckpointError, match="schema"):
        lin.read_manifest(a)


@pytest.mark.parametrize("relative", [False, True])
def test_chain_over_three_checkpoints(tmp_path, relative):
    a, b, c = three(tmp_path, relative)
    chain = lin.lineage_chain(c)
    assert [m.step for m in chain] == [3, 2, 1] and len(chain) == 3
    assert [Path(e.location) for e in chain.entries] == [c, b, a]
    assert chain.missing_parent is None and chain.note is None
    assert chain[0].data[0].name == "rollout-3"
    assert [m.step for m in lin.lineage_chain(b)] == [2, 1]


def test_file_uri_chain_and_uri_parents(tmp_path):
    a = make(tmp_path, 1, None)
    b = make(tmp_path, 2, f"file://{a}")
    c = make(tmp_path, 3, "../step-000002")  # relative to a file:// child
    chain = lin.lineage_chain(f"file://{c}")
    assert [m.step for m in chain] == [3, 2, 1]
    assert chain.entries[1].location == f"file://{b}"
    assert chain.entries[2].location == f"file://{a}"
    assert lin.resolve_parent("s3://bucket/exp/step-000003", "../step-000002") == "s3://bucket/exp/step-000002"
    assert lin.resolve_parent("s3://bucket/x", "gs://other/y") == "gs://other/y"


def test_missing_parent_ends_chain_with_marker(tmp_path):
    a, b, c = three(tmp_path)
    shutil.rmtree(a)
    chain = lin.lineage_chain(c)
    assert [m.step for m in chain] == [3, 2]
    assert chain.missing_parent == str(a)
    assert "could not be read" in chain.note
    text = lin.format_lineage(chain)
    assert "chain ends" in text and str(a) in text
    doc = json.loads(lin.format_lineage(chain, "json"))
    assert doc["missing_parent"] == str(a)
    with pytest.raises(CheckpointError):
        lin.lineage_chain(a)  # the starting point itself must exist


def _write_manifest(d: Path, step: int, parent: str | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    m = lin.build_manifest(experiment=EXP, step=step, iteration=step, parent=parent, base_model={"path": "/m"})
    (d / "manifest.json").write_text(m.model_copy(update={"complete": True}).model_dump_json())


def test_cycle_and_max_depth_stop_cleanly(tmp_path):
    x, y = tmp_path / "x", tmp_path / "y"
    _write_manifest(x, 2, str(y))
    _write_manifest(y, 1, "../x")
    chain = lin.lineage_chain(x)
    assert [m.step for m in chain] == [2, 1] and "cycle" in chain.note and chain.missing_parent is None
    _write_manifest(x / "self", 5, ".")
    assert len(lin.lineage_chain(x / "self")) == 1
    prev = None
    for i in range(6):
        _write_manifest(tmp_path / f"c{i}", i, prev)
        prev = str(tmp_path / f"c{i}")
    chain = lin.lineage_chain(prev, max_depth=3)
    assert [m.step for m in chain] == [5, 4, 3] and "max_depth=3" in chain.note


def test_format_text_and_json(tmp_path):
    a, b, c = three(tmp_path)
    chain = lin.lineage_chain(c)
    text = lin.format_lineage(chain)
    blocks = text.strip().split("\n\n")
    assert len(blocks) == 3
    assert blocks[0].startswith("step 3 (iteration 3, experiment exp, phase train)")
    assert f"path:     {c}" in blocks[0] and f"parent:   {b}" in blocks[0]
    assert f"rollout-3={SHA[:12]}" in blocks[0] and SHA not in text  # hashes shortened
    assert f"config:   {stable_hash(CFG)[:12]}" in blocks[0]
    assert f"code:     {rlpipe.__version__}" in blocks[0] and "created:" in blocks[0]
    assert "reward_mean=0.75" in blocks[0]
    assert "parent:   -" in blocks[2]
    doc = json.loads(lin.format_lineage(chain, fmt="json"))
    assert [e["manifest"]["step"] for e in doc["chain"]] == [3, 2, 1]
    assert doc["chain"][0]["location"] == str(c) and doc["missing_parent"] is None
    assert lin.Manifest.model_validate(doc["chain"][1]["manifest"]) == chain[1]
    with pytest.raises(ValueError):
        lin.format_lineage(chain, fmt="yaml")


def test_consecutive_reads_of_one_file_are_one_lineage_entry():
    from rlpipe.config import PipelineConfig
    from rlpipe.train.run_state import RunState

    run = RunState(PipelineConfig(), "unused-model-dir")
    for it in (301, 302, 303):
        run.record_data("prompts", it, "p.parquet", "aa")
        run.record_data("sft", it, "s.parquet", "bb")
    run.record_data("prompts", 304, "other.parquet", "cc")  # a new file starts a new entry
    run.record_data("prompts", 305, "other.parquet", "cc")
    data = run.data
    assert [d["name"] for d in data] == ["prompts@301-303", "sft@301-303", "prompts@304-305"]
    assert [d["path"] for d in data] == ["p.parquet", "s.parquet", "other.parquet"]
