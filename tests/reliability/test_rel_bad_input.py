"""Bad input: every case must exit `rlpipe run` with code 2, name the file/row/field (or config key) and leave no
checkpoint behind. Cases that only show up after a rollout are tested at the lowest level that raises them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlpipe import cli
from rlpipe.data.builtin_tasks import write_task_dataset
from rlpipe.data.datasets import PromptExample
from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.errors import ConfigError, DataError
from rlpipe.rollout.batch import build_rollout_batch, score_generations
from rlpipe.rollout.engine import Generation

from .conftest import fast_overrides

pytestmark = pytest.mark.reliability


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"prompt": "count the a in aab", "ground_truth": "2"}


def _case_files(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (extra --set overrides / args, substrings the error must contain)."""
    task = write_task_dataset("count", 8, 0, tmp / "task.parquet")
    renamed = tmp / "renamed.parquet"
    table = pq.read_table(task)
    pq.write_table(table.rename_columns(["question" if c == "prompt" else c for c in table.column_names]), renamed)
    truncated = tmp / "truncated.parquet"
    truncated.write_bytes(task.read_bytes()[: task.stat().st_size // 2])
    garbage = tmp / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all\n" * 10)
    csv = tmp / "data.csv"
    csv.write_text("prompt,ground_truth\nabc,1\n")
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("train:\n  lr: [1, 2\n")
    list_yaml = tmp / "list.yaml"
    list_yaml.write_text("- a\n- b\n")
    not_model = tmp / "not-a-model"
    not_model.mkdir()
    d = lambda name, rows: [f"data.path={_jsonl(tmp / name, rows)}"]  # noqa: E731
    return {
        "missing prompt column": (
            d("a.jsonl", [{"promt": "hi", "ground_truth": "1"}]),
            ["a.jsonl", "row 0", "'prompt'"],
        ),
        "mistyped ground_truth": (
            d("b.jsonl", [GOOD, {"prompt": "x", "ground_truht": "1"}]),
            ["row 1", "'ground_truth'"],
        ),
        "renamed parquet column": ([f"data.path={renamed}"], ["renamed.parquet", "row 0", "'prompt'"]),
        "wrong prompt_key": ([f"data.path={task}", "data.prompt_key=question"], ["row 0", "'question'"]),
        "empty prompt": (d("c.jsonl", [GOOD, GOOD, {"prompt": "  ", "ground_truth": "1"}]), ["row 2", "empty prompt"]),
        "empty messages": (d("e.jsonl", [{"prompt": [], "ground_truth": "1"}]), ["row 0", "no messages"]),
        "prompt not text": (d("f.jsonl", [GOOD, {"prompt": 7, "ground_truth": "1"}]), ["row 1", "'prompt'", "int"]),
        "bad json line": (d("g.jsonl", [GOOD, '{"prompt": "x",']), ["g.jsonl", "row 1", "not valid JSON"]),
        "extra_info not a dict": (d("h.jsonl", [{**GOOD, "extra_info": [1]}]), ["row 0", "'extra_info'"]),
        "prompt too long": (d("i.jsonl", [GOOD]) + ["data.max_prompt_length=4"], ["row 0", "max_prompt_length=4"]),
        "unreadable parquet": ([f"data.path={garbage}"], ["garbage.parquet", "not a readable parquet"]),
        "truncated parquet": ([f"data.path={truncated}"], ["truncated.parquet", "not a readable parquet"]),
        "unsupported suffix": ([f"data.path={csv}"], ["data.csv", "unsupported file suffix"]),
        "missing data file": ([f"data.path={tmp / 'nope.jsonl'}"], ["nope.jsonl", "cannot read file"]),
        "group size 1 with grpo": (["rollout.n=1"], ["rollout.n >= 2"]),
        "unknown config field": (["train.lrr=0.1"], ["train.lrr", "Extra inputs"]),
        "unknown section": (["trainer.lr=0.1"], ["trainer"]),
        "negative learning rate": (["train.lr=-1e-4"], ["train.lr", "greater than 0"]),
        "world size not dividing": (["train.world_size=3"], ["multiple of the data-parallel size"]),
        "unknown judge": (["rollout.judge=nope"], ["unknown judge 'nope'", "exact_match"]),
        "model path not a model": ([f"model.path={not_model}"], ["not-a-model", "config.json"]),
        "bad yaml": (["--config", str(bad_yaml)], ["bad.yaml", "not valid YAML"]),
        "yaml not a mapping": (["--config", str(list_yaml)], ["list.yaml", "mapping"]),
        "override without =": (["--raw", "train.lr"], ["must look like"]),
    }


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return _case_files(tmp_path_factory.mktemp("bad-input"))


def _argv(case_args: list[str], shared_out: Path, ckpt_root: Path) -> list[str]:
    argv, config = ["run"], None
    overrides = fast_overrides(shared_out, **{"checkpoint.root": str(ckpt_root)})
    sets = [f"{k}={v}" for k, v in overrides.items()]
    it = iter(case_args)
    for a in it:
        if a == "--config":
            config = next(it)
        elif a == "--raw":
            sets.append(next(it))
        else:
            sets.append(a)
    if config:
        argv.append(config)
    for s in sets:
        argv += ["--set", s]
    return argv


@pytest.mark.parametrize(
    "name",
    [
        "missing prompt column", "mistyped ground_truth", "renamed parquet column", "wrong prompt_key",
        "empty prompt", "empty messages", "prompt not text", "bad json line", "extra_info not a dict",
        "prompt too long", "unreadable parquet", "truncated parquet", "unsupported suffix", "missing data file",
        "group size 1 with grpo", "unknown config field", "unknown section", "negative learning rate",
        "world size not dividing", "unknown judge", "model path not a model", "bad yaml", "yaml not a mapping",
        "override without =",
    ],
)  # fmt: skip
def test_rlpipe_run_rejects_bad_input(name, cases, shared_out, tmp_path, capsys):
    args, expected = cases[name]
    ckpt_root = tmp_path / "ckpt"
    rc = cli.main(_argv(args, shared_out, ckpt_root))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "rlpipe: error:" in err
    for needle in expected:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not ckpt_root.exists(), "a failed run must not create a checkpoint directory"


# ------------------------------------------------------------------ failures that need a rollout, at the lowest level


def test_response_longer_than_pack_max_length_names_its_row():
    items = [SequenceItem([1, 2, 3], [4, 5], row=0), SequenceItem([1] * 10, [2] * 10, row=5)]
    with pytest.raises(DataError) as info:
        pack_sequences(items, 16, pad_token_id=0)
    assert info.value.row == 5 and "row 5" in str(info.value)
    assert len(pack_sequences(items[:1], 16, pad_token_id=0)) == 1  # the short one alone packs fine


def _examples(n_prompts: int) -> list[PromptExample]:
    return [PromptExample([1, 2], "1", "rlpipe/count", {}, row=10 + i, prompt_text="p") for i in range(n_prompts)]


def _gens(n_prompts: int, n: int) -> list[Generation]:
    return [Generation(p, s, [3, 4], [-0.5, -0.5], "stop") for p in range(n_prompts) for s in range(n)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_from_a_judge_is_a_data_error(bad):
    calls = []

    def judge(source, text, truth, extra):
        calls.append(text)
        return bad if len(calls) == 3 else 1.0

    with pytest.raises(DataError) as info:
        score_generations(_examples(2), _gens(2, 2), lambda ids: "x", judge)
    assert info.value.field == "reward" and info.value.row == 11  # the 3rd generation belongs to prompt row 11


def test_all_groups_filtered_out_skips_the_update_and_logs_it():
    """Uniform rewards + filter_uniform_groups: the batch is empty; the session logs, counts the iteration as
    done (so the run moves on) and never calls the trainer."""
    from rlpipe.session import RLSession
    from rlpipe.train.checkpoint import Counters

    rewards = np.ones(8, dtype=np.float32)
    batch, stats = build_rollout_batch(_examples(2), _gens(2, 4), ["x"] * 8, rewards, 4, "grpo", None, True)
    assert len(batch) == 0 and stats["kept_groups"] == 0.0 and stats["uniform_group_fraction"] == 1.0

    class NoTrainer:
        def fit(self, *a, **k):
            raise AssertionError("the trainer must not be called on an empty batch")

    logs: list[str] = []
    fake = type("S", (), {})()
    fake.counters, fake.log, fake.controller = Counters(iteration=4), logs.append, NoTrainer()
    metrics = RLSession.train(fake, batch)
    assert metrics == {"skipped_iteration": 1.0}
    assert fake.counters.iteration == 5 and fake.counters.step == 0
    assert any("filtered out" in m and "iteration 5" in m for m in logs)
    kept, _ = build_rollout_batch(_examples(2), _gens(2, 4), ["x"] * 8, rewards, 4, "grpo", None, False)
    assert len(kept) == 8 and np.allclose(kept["advantage"], 0.0)  # without the filter: kept, zero advantage


def test_mismatched_tokenizer_and_model_is_a_config_error(base_model_dir):
    from transformers import AutoModelForCausalLM

    from rlpipe.models.loading import check_tokenizer_matches, load_model, load_tokenizer

    tok = load_tokenizer(base_model_dir)
    model = load_model(base_model_dir)
    check_tokenizer_matches(model, tok)  # the pair that belongs together passes
    small = AutoModelForCausalLM.from_config(model.config.__class__(**{**model.config.to_dict(), "vocab_size": 8}))
    with pytest.raises(ConfigError, match="tokenizer/model mismatch"):
        check_tokenizer_matches(small, tok, where="test")
    bigger = AutoModelForCausalLM.from_config(
        model.config.__class__(**{**model.config.to_dict(), "vocab_size": len(tok) + 64})
    )
    check_tokenizer_matches(bigger, tok)  # a padded (larger) embedding is fine
    assert torch.is_tensor(small.get_input_embeddings().weight)


def test_batch_file_missing_a_column_names_it(tmp_path):
    from rlpipe.rollout.batch import read_batch

    path = tmp_path / "batch.parquet"
    pq.write_table(pa.Table.from_pandas(pd.DataFrame({"group_id": [0]})), path)
    with pytest.raises(DataError) as info:
        read_batch(path)
    assert info.value.file == str(path) and info.value.field == "sample_index"


def test_a_prompt_file_too_small_for_one_batch_names_the_key_and_the_file(tmp_path, shared_out, base_model_dir):
    """Before: `batch_size 8 exceeds the 3 examples ...`, naming neither `rollout.prompts_per_step` nor the data file.
    Found while opening the session, before any Ray worker starts."""
    from rlpipe.config import load_config
    from rlpipe.session import RLSession

    data = write_task_dataset("count", 3, 0, tmp_path / "three.parquet")
    cfg = load_config(overrides=fast_overrides(shared_out, **{"data.path": str(data), "rollout.prompts_per_step": 8}))
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step=8 with .*three\.parquet \(3 rows\)"):
        RLSession(cfg, base_model_dir, log=lambda _m: None)
