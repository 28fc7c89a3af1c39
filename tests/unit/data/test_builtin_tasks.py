"""Built-in synthetic tasks: determinism, correct answers (checked by an independent solver), size limits, files."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlpipe.data.builtin_tasks import (
    BUILTIN_TASKS,
    builtin_charset,
    make_sft_rows,
    make_task_rows,
    tiny_task_names,
    write_task_dataset,
)
from rlpipe.data.datasets import load_prompt_dataset
from rlpipe.data.sft import load_sft_dataset
from rlpipe.errors import ConfigError


def solve(prompt: str) -> str:
    """Independent reference solver parsing the prompt text."""
    words = prompt.split(" ")
    if words[0] == "reverse":
        assert len(words) == 2 and words[1].isdigit() and 3 <= len(words[1]) <= 5
        return words[1][::-1]
    if words[0] == "add":
        a, b = words[1].split("+")
        assert 0 <= int(a) <= 49 and 0 <= int(b) <= 49
        return str(int(a) + int(b))
    if words[0] == "sum":
        a, b = words[1].split("+")
        assert len(a) == len(b) == 1
        return str(int(a) + int(b))
    if words[0] == "count":
        assert words[2] == "in" and len(words[1]) == 1
        return str(sum(1 for ch in words[3] if ch == words[1]))
    raise AssertionError(prompt)


@pytest.mark.parametrize("task", tiny_task_names())
def test_rows_are_correct_small_and_deterministic(task: str) -> None:
    rows = make_task_rows(task, 300, seed=11)
    assert rows == make_task_rows(task, 300, seed=11)
    assert rows != make_task_rows(task, 300, seed=12)
    assert rows[:50] == make_task_rows(task, 50, seed=11)  # example i does not depend on n
    charset = set(builtin_charset())
    for i, row in enumerate(rows):
        (msg,) = row["prompt"]
        assert msg["role"] == "user"
        text, answer = msg["content"], row["ground_truth"]
        assert solve(text) == answer == row["reward_model"]["ground_truth"]
        assert row["data_source"] == f"rlpipe/{text.split(' ')[0]}"
        assert row["extra_info"] == {"index": i}
        assert len(text) <= 20 and 1 <= len(answer) <= 6
        assert set(text) <= charset and set(answer) <= charset
    if task == "mix":
        assert {r["data_source"] for r in rows} == {f"rlpipe/{t}" for t in BUILTIN_TASKS if BUILTIN_TASKS[t].tiny}
    else:
        distinct = len({r["prompt"][0]["content"] for r in rows})
        assert distinct > (90 if task == "sum" else 100)  # not degenerate (sum has only 100 facts)


def test_sft_rows_match_rl_rows() -> None:
    rl, sft = make_task_rows("add", 20, 3), make_sft_rows("add", 20, 3)
    assert [r["prompt"] for r in rl] == [s["prompt"] for s in sft]
    assert [r["ground_truth"] for r in rl] == [s["response"] for s in sft]


def test_charset_sorted_unique() -> None:
    cs = builtin_charset()
    assert list(cs) == sorted(set(cs)) and " " in cs and set("0123456789+") <= set(cs)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        make_task_rows("nope", 3, 0)
    with pytest.raises(ConfigError):
        make_task_rows("add", -1, 0)
    with pytest.raises(ConfigError):
        write_task_dataset("add", 2, 0, "x.jsonl", kind="other")  # type: ignore[arg-type]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_write_and_load_round_trip(tmp_path: Path, tokenizer, suffix: str) -> None:
    path = write_task_dataset("mix", 40, 5, tmp_path / "sub" / f"rl{suffix}")
    ds = load_prompt_dataset(path, tokenizer, max_prompt_length=40)
    rows = make_task_rows("mix", 40, 5)
    assert [e.ground_truth for e in ds.examples] == [r["ground_truth"] for r in rows]
    assert [e.data_source for e in ds.examples] == [r["data_source"] for r in rows]
    assert [e.extra_info["index"] for e in ds.examples] == list(range(40))
    assert not list(path.parent.glob(".*tmp"))  # atomic write left no temp file
    sft_path = write_task_dataset("reverse", 10, 5, tmp_path / f"sft{suffix}", kind="sft")
    sft = load_sft_dataset(sft_path, tokenizer, max_length=48)
    assert [tokenizer.decode(e.response_ids) for e in sft.examples] == [
        r["response"] + "<eos>" for r in make_sft_rows("reverse", 10, 5)
    ]
