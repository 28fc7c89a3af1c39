"""Judges: positive, negative and edge cases for every judge; dispatch; registry; group filter."""

from __future__ import annotations

import pytest
import torch

from rlpipe.errors import ConfigError
from rlpipe.rollout.judges import (
    JUDGES,
    extract_gsm8k_answer,
    filter_uniform_groups,
    get_judge,
    judge_name_for,
    last_boxed,
    normalize_math,
    score_generations,
)


@pytest.mark.parametrize(
    "sol,gt,want",
    [
        ("321", "321", 1.0),
        ("  321\n", "321", 1.0),
        ("321", " 321 ", 1.0),
        ("3 21", "321", 0.0),
        ("", "321", 0.0),
        ("", "", 1.0),
        ("3210", "321", 0.0),
        ("abc", "ABC", 0.0),
    ],
)
def test_exact_match(sol, gt, want):
    assert JUDGES["exact_match"]("x", sol, gt, None) == want


def test_builtin_is_exact():
    assert JUDGES["builtin"]("rlpipe/reverse", "cba", "cba", {"index": 0}) == 1.0
    assert JUDGES["builtin"]("rlpipe/reverse", "abc", "cba", {"index": 0}) == 0.0


@pytest.mark.parametrize(
    "sol,gt,want",
    [
        ("She has 3+4=7 apples.\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 72.0", "72", 1.0),
        ("#### $18", "18", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("The answer is 7", "7", 0.0),  # strict needs the marker
        ("#### 6\n#### 7", "7", 1.0),  # last marker wins
        ("#### 8", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # full reference solution as ground truth
        ("####", "7", 0.0),
    ],
)
def test_gsm8k_strict(sol, gt, want):
    assert JUDGES["gsm8k"]("openai/gsm8k", sol, gt, None) == want


@pytest.mark.parametrize(
    "sol,want",
    [
        ("so 3 + 4 = 7", 1.0),
        ("The answer is 7.", 1.0),
        ("7 apples and then 8", 0.0),
        ("no number", 0.0),
        ("total: 1,007", 0.0),
        ("#### 7", 1.0),
    ],
)
def test_gsm8k_flexible(sol, want):
    assert JUDGES["gsm8k_flexible"]("openai/gsm8k", sol, "7", None) == want
    assert JUDGES["gsm8k"]("openai/gsm8k", sol, "7", {"method": "flexible"}) == want


@pytest.mark.parametrize(
    "sol,want",
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("#### 7.", 1.0),  # trailing period
        ("####7", 1.0),
        ("#### \t 7 \n", 1.0),  # whitespace
        ("#### 7 apples", 1.0),
        ("#### $7", 1.0),
        ("#### 1,007", 0.0),  # commas are read as thousands separators: 1007, not 7
        ("#### 8\n#### 7", 1.0),  # the last marker counts
        ("#### 7\n#### 8", 0.0),
        ("#### 7\n#### 7abc", 0.0),  # malformed last answer: 0 although an earlier one was right
        ("#### seven", 0.0),
        ("#### 7.7.7", 0.0),
        ("#### **7**", 0.0),
        ("####", 0.0),
        ("The answer is 7", 0.0),  # no marker
        ("", 0.0),
    ],
)
def test_word_problems_judge(sol, want):
    """rlpipe/word_problems (ground truth 7) is scored by the strict GSM8K judge, through auto and builtin."""
    assert judge_name_for("rlpipe/word_problems") == "gsm8k"
    assert JUDGES["auto"]("rlpipe/word_problems", sol, "7", {"index": 0}) == want
    assert JUDGES["builtin"]("rlpipe/word_problems", sol, "7", {"index": 0}) == want
    assert JUDGES["gsm8k"]("rlpipe/word_problems", sol, "1007", None) == float(sol == "#### 1,007")


def test_gsm8k_extract_modes():
    assert extract_gsm8k_answer("a 1 b 2,500 #### 3", "strict") == "3"
    assert extract_gsm8k_answer("a 1 b 2,500", "flexible") == "2,500"
    assert extract_gsm8k_answer("a 1 b 2,500", "strict") is None
    with pytest.raises(ConfigError):
        extract_gsm8k_answer("1", "fuzzy")


@pytest.mark.parametrize(
    "text,want",
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b}}} end", r"\sqrt{\frac{a}{b}}"),
        (r"\fbox{x}", "x"),
        (r"\boxed 5$", "5"),
        (r"\boxed{unclosed {", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize(
    "sol,gt,want",
    [
        (r"The answer is $\boxed{\dfrac{1}{2}}$.", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", "0.50", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{\text{(B)}}", "(B)", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{3}", r"the answer is \boxed{3}", 1.0),  # boxed ground truth
        (r"\boxed{4}", "3", 0.0),
        ("3", "3", 0.0),  # no box: no reward
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    ],
)
def test_boxed_math(sol, gt, want):
    assert JUDGES["boxed_math"]("lighteval/MATH", sol, gt, None) == want


def test_normalize_math():
    assert normalize_math(r" $\tfrac{3}{4}$. ") == r"\frac{3}{4}"
    assert normalize_math("12,345") == "12345"
    assert normalize_math("(1,2)") == "(1,2)"  # a tuple keeps its comma


@pytest.mark.parametrize(
    "ds,name",
    [
        ("openai/gsm8k", "gsm8k"),
        ("rlpipe/reverse", "builtin"),
        ("lighteval/MATH", "boxed_math"),
        ("DigitalLearningGmbH/MATH-lighteval", "boxed_math"),
        ("aime24", "boxed_math"),
        ("my/qa", "exact_match"),
    ],
)
def test_auto_dispatch(ds, name):
    assert judge_name_for(ds) == name


def test_auto_scores_like_the_dispatched_judge():
    auto = JUDGES["auto"]
    assert auto("openai/gsm8k", "#### 7", "7", None) == 1.0
    assert auto("openai/gsm8k", "7", "7", None) == 0.0  # strict gsm8k, not exact match
    assert auto("lighteval/MATH", r"\boxed{7}", "7", None) == 1.0
    assert auto("rlpipe/add", "7", "7", None) == 1.0
    assert auto("other", " 7 ", "7", None) == 1.0


def test_get_judge():
    assert get_judge("gsm8k") is JUDGES["gsm8k"]
    with pytest.raises(ConfigError, match="known judges: .*boxed_math.*exact_match"):
        get_judge("nope")


def test_score_generations():
    got = score_generations("auto", ["rlpipe/x", "openai/gsm8k"], ["a", "#### 2"], ["a", "3"])
    assert got == [1.0, 0.0]
    with pytest.raises(ConfigError):
        score_generations("auto", ["a"], ["a", "b"], ["a", "b"])


def test_filter_uniform_groups_against_loop():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    expected = [len(set(row.tolist())) > 1 for row in rewards]
    assert filter_uniform_groups(rewards).tolist() == expected == [False, True, False, True]
    assert filter_uniform_groups(torch.tensor([[1.0]])).tolist() == [False]  # n == 1: never informative
    assert filter_uniform_groups(torch.zeros(0, 4)).shape == (0,)
    with pytest.raises(ConfigError):
        filter_uniform_groups(torch.zeros(4))
