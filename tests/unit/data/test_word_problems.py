"""The `word_problems` task: determinism, disjoint splits, answers checked by an independent parser of the story."""

from __future__ import annotations

import re

import pytest

from rlpipe.data.builtin_tasks import (
    HELD_OUT_BUCKETS,
    WORD_PROBLEM_INSTRUCTION,
    generate_examples,
    make_sft_rows,
    make_task_rows,
    split_of,
    tiny_task_names,
)
from rlpipe.errors import ConfigError
from rlpipe.rollout.judges import get_judge

# One pattern per story shape, written from the English text (not from the generator): numbers are captured in
# story order and the answer is recomputed from them.
_N = r"(\d+)"
_W = r"[A-Z][a-z]+"
SHAPES = [
    (rf"^{_W} has {_N} \w+\. {_W} gives {_W} {_N} more\. How many \w+ does {_W} have now\?$", lambda a, b: a + b, 1),
    (rf"^{_W} has {_N} \w+ and gives {_N} of them to {_W}\. How many \w+ does {_W} have left\?$",
     lambda a, b: a - b, 1),
    (rf"^{_W} buys {_N} boxes of \w+\. Each box holds {_N} \w+\. How many \w+ does {_W} buy\?$",
     lambda a, b: a * b, 1),
    (rf"^{_W} shares {_N} \w+ equally among {_N} friends\. How many \w+ does each friend get\?$",
     lambda a, b: a // b if a % b == 0 else None, 1),
    (rf"^{_W} has {_N} \w+\. {_W} buys {_N} packs with {_N} \w+ in each pack\. How many \w+ does {_W} have now\?$",
     lambda a, b, c: a + b * c, 2),
    (rf"^{_W} has {_N} \w+, gives {_N} to {_W}, and then finds {_N} more\. How many \w+ does {_W} have now\?$",
     lambda a, b, c: a - b + c, 2),
    (rf"^{_W} has {_N} \w+\. {_W} has {_N} more \w+ than {_W}\. How many \w+ do they have together\?$",
     lambda a, b: a + (a + b), 2),
    (rf"^{_W} has {_N} \w+\. {_W} buys {_N} packs with {_N} \w+ in each pack, then gives {_N} \w+ to {_W}\. "
     rf"How many \w+ does {_W} have left\?$", lambda a, b, c, d: a + b * c - d, 3),
]  # fmt: skip


def parse(prompt: str) -> tuple[int, tuple[int, ...], int, int]:
    """(shape index, numbers, steps, answer) of a prompt; fails if no shape matches or the answer is not a
    positive integer."""
    story, instruction = prompt.split("\n")
    assert instruction == WORD_PROBLEM_INSTRUCTION and "####" in instruction
    for i, (pattern, solve, steps) in enumerate(SHAPES):
        m = re.match(pattern, story)
        if m:
            numbers = tuple(int(g) for g in m.groups())
            answer = solve(*numbers)
            assert answer is not None and answer > 0, prompt
            return i, numbers, steps, answer
    raise AssertionError(f"no shape matches {story!r}")


def test_answers_match_an_independent_parse_and_all_shapes_occur() -> None:
    rows = make_task_rows("word_problems", 400, seed=3)
    shapes, steps = set(), set()
    for row in rows:
        shape, _, k, answer = parse(row["prompt"][0]["content"])
        assert row["ground_truth"] == row["reward_model"]["ground_truth"] == str(answer)
        assert row["data_source"] == "rlpipe/word_problems"
        shapes.add(shape)
        steps.add(k)
    assert shapes == set(range(len(SHAPES))) and steps == {1, 2, 3}


def test_deterministic_and_independent_of_n() -> None:
    rows = make_task_rows("word_problems", 60, seed=5)
    assert rows == make_task_rows("word_problems", 60, seed=5)
    assert rows[:20] == make_task_rows("word_problems", 20, seed=5)
    assert rows != make_task_rows("word_problems", 60, seed=6)
    assert len({r["prompt"][0]["content"] for r in rows}) > 55  # not degenerate


def test_splits_are_disjoint_by_problem_not_just_by_text() -> None:
    """No held-out (shape, numbers) appears in training, even renamed; across different seeds too."""
    train = {
        parse(r["prompt"][0]["content"])[:2] for seed in (0, 1) for r in make_task_rows("word_problems", 1500, seed)
    }
    held = [parse(r["prompt"][0]["content"])[:2] for r in make_task_rows("word_problems", 400, 0, split="eval")]
    assert not train & set(held)
    assert len(set(held)) > 150  # the held-out split is not a handful of repeated problems
    assert set(make_task_rows("word_problems", 50, 0, "eval")[i]["ground_truth"] for i in range(50))


def test_split_keys_fall_in_their_bucket() -> None:
    for split in ("train", "eval"):
        exs = [ex for _, ex in generate_examples("word_problems", 200, 9, split)]
        assert {split_of(ex.split_key) for ex in exs} == {split}
    # about 1/HELD_OUT_BUCKETS of all keys are held out (sha256 spreads them): a loose check on 2000 fresh keys
    held = sum(split_of(f"k:{i}") == "eval" for i in range(2000)) / 2000
    assert abs(held - 1 / HELD_OUT_BUCKETS) < 0.04


def test_demonstration_is_worked_steps_ending_in_the_answer_and_scores_1() -> None:
    judge = get_judge("auto")
    for sft, rl in zip(make_sft_rows("word_problems", 50, 2), make_task_rows("word_problems", 50, 2), strict=True):
        assert sft["prompt"] == rl["prompt"]
        lines = sft["response"].split("\n")
        assert lines[-1] == f"#### {rl['ground_truth']}"
        assert len(lines) - 1 == parse(rl["prompt"][0]["content"])[2]  # one equation per step
        for eq in lines[:-1]:  # each written equation is true
            lhs, rhs = eq.split(" = ")
            a, op, b = lhs.split(" ")
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) / int(b)}[op] == int(
                rhs
            )
        assert judge(rl["data_source"], sft["response"], rl["ground_truth"], rl["extra_info"]) == 1.0


def test_not_a_tiny_task_and_bad_split() -> None:
    assert "word_problems" not in tiny_task_names()
    assert make_task_rows("sum", 30, 1, "eval") == make_task_rows("sum", 30, 1)  # tiny tasks split by seed only
    assert all(r["data_source"] != "rlpipe/word_problems" for r in make_task_rows("mix", 300, 0))
    with pytest.raises(ConfigError, match="split"):
        make_task_rows("word_problems", 2, 0, split="test")  # type: ignore[arg-type]


def test_tiny_default_model_refuses_word_problems(tmp_path) -> None:
    from rlpipe.base_model import prepare_base_model
    from rlpipe.config import load_config

    cfg = load_config(overrides={"data.task": "word_problems", "output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="model.path"):
        prepare_base_model(cfg, log=lambda _msg: None)
    assert not (tmp_path / "base-models").exists()
