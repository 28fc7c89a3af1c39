"""Issue 30, the hardening classes: names that cannot escape their roots, a resume that never silently starts over,
ground truth that keeps its meaning, config errors found before Ray, metrics rows that agree with checkpoints.

Every test here runs without Ray (milliseconds to a few seconds); the killed-driver case is in
`test_rel_killed_driver.py`.
"""

from __future__ import annotations

import json
import math
import os
import types
import typing
import warnings
from pathlib import Path

import pandas as pd
import pytest
from pydantic import BaseModel

from rlpipe import cli
from rlpipe.config import PipelineConfig, load_config
from rlpipe.data.datasets import load_prompt_dataset
from rlpipe.errors import CheckpointError, ConfigError, DataError
from rlpipe.io import atomic_write_json, sha256_file
from rlpipe.models.loading import load_tokenizer
from rlpipe.rollout.judges import get_judge
from rlpipe.train import checkpoint as ckpt
from rlpipe.train.lineage import MANIFEST_NAME

from .conftest import fast_overrides

pytestmark = pytest.mark.reliability


def _argv(overrides: dict, *extra: str) -> list[str]:
    return ["run", *extra] + [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


# ------------------------------------------------------------------------------------------------- 1. names


ESCAPING_NAMES = ["a/b/../../../up", "/abs/elsewhere", "..", ".", "", "a\0b", "a\nb", "x" * 129, ".hidden", "a b"]


@pytest.mark.parametrize("name", ESCAPING_NAMES, ids=repr)
def test_experiment_that_is_not_one_path_component_is_a_config_error(name):
    with pytest.raises(ConfigError, match="experiment"):
        load_config(overrides={"experiment": name})


def test_escaping_experiment_through_the_cli_writes_nothing(shared_out, tmp_path, capsys):
    """Before: exit 0 and the checkpoint written outside checkpoint.root, the metrics outside output_dir."""
    ov = fast_overrides(shared_out, **{"checkpoint.root": str(tmp_path / "ckpt"), "experiment": "a/b/../../../up"})
    assert cli.main(_argv(ov)) == 2
    assert "experiment" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "up").exists()


def test_data_task_is_a_name():
    with pytest.raises(ConfigError, match="data.task"):
        load_config(overrides={"data.task": "../../etc"})


def test_every_write_path_is_checked_inside_its_root(tmp_path):
    """Defence in depth for names that bypass config validation (a manifest, a Flyte input, model_construct)."""
    from rlpipe.io import inside_root

    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    for parts in (("a/../../x",), ("/etc",), ("..",), (".",), ("link", "x"), ("a\nb",)):
        with pytest.raises(ConfigError):
            inside_root(root, *parts)
    assert inside_root(root, "exp", "metrics.jsonl") == root / "exp" / "metrics.jsonl"
    with pytest.raises(ConfigError, match="outside its root"):
        ckpt.begin_checkpoint(root, "../escaped", 1)
    assert not (tmp_path / "escaped").exists()
    from rlpipe.data.loaders import builtin_task_file
    from rlpipe.rollout.sources import serving_root

    bad = PipelineConfig.model_construct(**{**dict(PipelineConfig()), "experiment": "../../x", "output_dir": str(root)})
    with pytest.raises(ConfigError):
        serving_root(bad)
    bad_task = bad.model_copy(update={"data": bad.data.model_construct(**{**dict(bad.data), "task": "../../t"})})
    with pytest.raises(ConfigError):
        builtin_task_file(bad_task, "rl", 4, 0)


# ---------------------------------------------------------------------------------------- 2. resume never restarts


def _resume_argv(shared_out: Path, fake_checkpoint: Path, **extra) -> list[str]:
    ov = fast_overrides(
        shared_out, **{"checkpoint.root": str(fake_checkpoint.parent.parent), "experiment": "exp", **extra}
    )
    return _argv(ov, "--resume")


def test_resume_with_a_corrupt_only_checkpoint_stops_and_says_how_to_proceed(shared_out, fake_checkpoint, capsys):
    """Before: exit 0, no message, training from the base model next to the corrupt step."""
    manifest = fake_checkpoint / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:40])
    assert cli.main(_resume_argv(shared_out, fake_checkpoint)) == 2
    err = capsys.readouterr().err
    assert str(fake_checkpoint) in err and "move it out" in err and "explicit older checkpoint" in err
    assert sorted(p.name for p in fake_checkpoint.parent.iterdir()) == [fake_checkpoint.name]


def test_resume_with_a_corrupt_newer_checkpoint_does_not_fall_back_silently(shared_out, fake_checkpoint, capsys):
    newer = fake_checkpoint.parent / "step-000007"
    newer.mkdir()  # a killed copy, a half-restored backup: no manifest
    assert cli.main(_resume_argv(shared_out, fake_checkpoint)) == 2
    err = capsys.readouterr().err
    assert str(newer) in err and str(fake_checkpoint) in err  # names the bad one and what a fix resumes from


def test_flyte_start_point_refuses_a_corrupt_checkpoint(shared_out, fake_checkpoint):
    from tasks import storage

    (fake_checkpoint.parent / "step-000009").mkdir()
    cfg = load_config(overrides={"checkpoint.root": str(fake_checkpoint.parent.parent), "experiment": "exp"})
    assert storage.latest_location(cfg) == str(fake_checkpoint.absolute())  # listing still skips it
    with pytest.raises(CheckpointError, match="step-000009"):
        storage.resume_location(cfg)


def _rewrite_state(checkpoint: Path, edit) -> None:
    """Change train_state.json and re-sign it in the manifest, so only the semantic check can catch it."""
    path = checkpoint / ckpt.TRAIN_STATE_NAME
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    manifest["files"][ckpt.TRAIN_STATE_NAME] = sha256_file(path)
    atomic_write_json(checkpoint / MANIFEST_NAME, manifest)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: s["counters"].update(iteration=2), "counters.iteration=2"),
        (lambda s: s["counters"].update(step=4), "counters.step=4"),
        (lambda s: s["counters"].update(iteration="3", step="3"), "TrainState schema"),
        (lambda s: s.update(format=3), "TrainState schema"),
    ],
    ids=["iteration", "step", "counters-as-strings", "format"],
)
def test_train_state_disagreeing_with_its_manifest_fails_verification(fake_checkpoint, edit, words):
    """Before: it verified and resumed, repeating an iteration."""
    _rewrite_state(fake_checkpoint, edit)
    with pytest.raises(CheckpointError, match=words.replace(".", r"\.")):
        ckpt.verify_checkpoint(fake_checkpoint)


# ------------------------------------------------------------------------------------------- 3. ground truth


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from rlpipe.base_model import prepare_base_model

    root = tmp_path_factory.mktemp("gt")
    return load_tokenizer(prepare_base_model(load_config(overrides=fast_overrides(root)), log=lambda _m: None))


def _prompts(path: Path, tokenizer):
    return load_prompt_dataset(path, tokenizer, 64, apply_chat_template=False)


def test_float_ground_truth_column_from_ints_still_matches(tmp_path, tokenizer):
    """Before: truths '10.0' never matched '10' (reward 0.0, exit 0)."""
    from rlpipe.data.reading import WidenedColumnWarning

    path = tmp_path / "gt.parquet"
    df = pd.DataFrame({"prompt": ["1+9", "2+2"], "ground_truth": [10, None], "data_source": "exact"})
    df["reward_model"] = [None, {"ground_truth": "4"}]
    df.to_parquet(path)
    with pytest.warns(WidenedColumnWarning, match="'ground_truth'.*1 missing"):
        data = _prompts(path, tokenizer)
    assert [e.ground_truth for e in data.examples] == ["10", "4"]  # the gap falls back to reward_model
    judge = get_judge("exact_match")
    assert judge("exact", "10", data.examples[0].ground_truth) == 1.0


def test_missing_ground_truth_without_fallback_names_the_file_and_row(tmp_path, tokenizer):
    path = tmp_path / "gt.parquet"
    pd.DataFrame({"prompt": ["a", "b", "c"], "ground_truth": [1.0, 2.5, float("nan")]}).to_parquet(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DataError, match=r"gt\.parquet, row 2, field 'ground_truth'"):
            _prompts(path, tokenizer)


def test_jsonl_nan_truth_is_not_the_string_nan(tmp_path, tokenizer):
    """Before: a jsonl NaN truth became the string 'nan'."""
    path = tmp_path / "gt.jsonl"
    path.write_text('{"prompt": "a", "ground_truth": 2.5}\n{"prompt": "b", "ground_truth": NaN}\n')
    with pytest.raises(DataError, match="row 1, field 'ground_truth'"):
        _prompts(path, tokenizer)
    path.write_text('{"prompt": "b", "ground_truth": NaN, "reward_model": {"ground_truth": 7.0}}\n')
    assert _prompts(path, tokenizer).examples[0].ground_truth == "7"


@pytest.mark.parametrize("judge", ["gsm8k", "boxed_math", "exact_match"])
def test_numeric_judges_compare_an_integral_float_truth_as_its_integer(judge, tmp_path, tokenizer):
    path = tmp_path / "gt.jsonl"
    path.write_text('{"prompt": "a", "ground_truth": 10.0}\n')
    truth = _prompts(path, tokenizer).examples[0].ground_truth
    answer = {"gsm8k": "so #### 10", "boxed_math": "\\boxed{10}", "exact_match": "10"}[judge]
    assert get_judge(judge)("src", answer, truth) == 1.0


# ------------------------------------------------------------------------------------ 4. errors found before Ray


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"train.seed": 2**64}, "train.seed"),  # torch: Overflow when unpacking long long
        ({"train.seed": -1}, "train.seed"),  # numpy SeedSequence: expected non-negative integer
        ({"data.seed": 2**63}, "data.seed"),
        ({"data.seed": -5}, "data.seed"),
        ({"train.betas": [0.9, 1.0]}, "train.betas"),
        ({"train.betas": [-0.1, 0.999]}, "train.betas"),
        ({"train.lr": float("nan")}, "train.lr"),
        ({"train.grad_clip": float("inf")}, "train.grad_clip"),
        ({"rollout.temperature": float("inf")}, "rollout.temperature"),
        ({"algo.rollout_is.lower": float("nan")}, "algo.rollout_is.lower"),
        ({"model.tiny.rope_theta": float("inf")}, "model.tiny.rope_theta"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "",
)
def test_values_torch_or_the_workers_would_reject_are_config_errors(override, key):
    """Before: each passed validation and crashed after Ray started (or read as 'a training worker was lost')."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(overrides=override)


def test_the_largest_valid_seed_is_accepted_by_torch_and_numpy():
    import numpy as np
    import torch

    from rlpipe.config import SEED_LIMIT

    cfg = load_config(overrides={"train.seed": SEED_LIMIT - 1, "data.seed": SEED_LIMIT - 1})
    torch.manual_seed(cfg.train.seed + 7)  # seed + rank
    np.random.default_rng([cfg.data.seed, 0])
    torch.manual_seed((cfg.train.seed * 100_003 + 400) % SEED_LIMIT)  # the sampling seed of RLSession


def _bounds(info) -> dict:
    """ge/gt/le/lt of a pydantic field."""
    return {
        a: getattr(m, a) for m in info.metadata for a in ("ge", "gt", "le", "lt") if getattr(m, a, None) is not None
    }


def _edge_values(annotation, meta: dict) -> list:
    """Values at the edges of a field's type and bounds."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [v for a in args for v in _edge_values(a, meta)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    if annotation is bool:
        return [True, False]
    if annotation is int:
        low = meta.get("ge", meta["gt"] + 1 if "gt" in meta else -(2**62))
        high = meta.get("le", meta["lt"] - 1 if "lt" in meta else 2**62)
        return [low, high]
    if annotation is float:
        low = meta.get("ge", math.nextafter(meta["gt"], math.inf) if "gt" in meta else -1e308)
        high = meta.get("le", math.nextafter(meta["lt"], -math.inf) if "lt" in meta else 1e308)
        return [low, high, 1e-300, math.inf, -math.inf, math.nan]  # inf/NaN: read back as null before
    if annotation is str:
        return ['ünïcode "quoted" \\ back\nslash \t']
    if annotation is type(None):
        return [None]
    if typing.get_origin(annotation) is list:
        return [[], ["--flag", "ü"]]
    if typing.get_origin(annotation) is tuple:
        return [(0.0, math.nextafter(1.0, 0.0))]
    return []


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", ann, info


def test_every_field_at_its_edges_survives_the_json_trip_to_the_workers():
    """The workers get `cfg.model_dump_json()` (rlpipe.train.controller); any valid value must come back equal."""
    tried = rejected = 0
    for dotted, ann, info in _leaf_fields(PipelineConfig):
        for value in _edge_values(ann, _bounds(info)):
            try:
                cfg = load_config(overrides={dotted: value})
            except ConfigError:
                rejected += 1  # a cross-field rule or a name rule: rejected before Ray is what we want
                continue
            tried += 1
            back = PipelineConfig.model_validate_json(cfg.model_dump_json())
            assert back == cfg, f"{dotted}={value!r} changed in the JSON trip"  # NaN != NaN: fails too
    assert tried > 150, (tried, rejected)


def test_non_utf8_yaml_is_a_config_error_naming_the_file(tmp_path):
    """Before: a UnicodeDecodeError traceback."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("experiment: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{path}.*not UTF-8"):
        load_config(path)


def test_unwritable_checkpoint_root_is_found_at_start(shared_out, tmp_path, capsys):
    """Before: found at the first save, after a whole segment of training. Now before Ray; nothing is created."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    out = tmp_path / "out"
    ov = fast_overrides(shared_out, **{"checkpoint.root": str(blocker / "ckpt"), "output_dir": str(out)})
    assert cli.main(_argv(ov)) == 2
    err = capsys.readouterr().err
    assert "checkpoint.root" in err and str(blocker) in err and "not a directory" in err
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["blocker"]


# --------------------------------------------------------------------------------- 6. metrics rows vs checkpoints


def test_resume_after_a_kill_between_metrics_append_and_checkpoint_keeps_one_row_per_iteration(
    shared_out, fake_checkpoint, tmp_path, capsys
):
    """A kill after iteration 5's row was appended but before its checkpoint leaves rows 4-5 (and maybe a torn
    line) past the iteration-3 checkpoint; the resume repeats 4-5. Before: rows 4 and 5 twice."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"iteration": float(i), "loss": 0.1 * i}) for i in range(1, 6)]
    metrics.write_text("\n".join(rows) + '\n{"iteration": 6.0, "lo')  # torn by the kill
    argv = _resume_argv(shared_out, fake_checkpoint, iterations=3) + ["--metrics", str(metrics)]
    assert cli.main(argv) == 0, capsys.readouterr().err  # iteration 3 is done: no segment runs, no Ray
    assert metrics.read_text().splitlines() == rows[:3]
