"""Rule-based reward functions ("judges") with verl's signature, and the group filter.

Signature (verl ``compute_score``): ``judge(data_source, solution_str, ground_truth, extra_info) -> float``.
``solution_str`` is the decoded response (special tokens skipped); rewards are 1.0 (correct) or 0.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlpipe.errors import ConfigError

Judge = Callable[[str, str, str, Any], float]

# ---------------------------------------------------------------------------------------------- exact match


def exact_match(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """1.0 iff the response equals the ground truth after stripping surrounding whitespace."""
    return float(solution_str.strip() == str(ground_truth).strip())


# Built-in tasks answered in the GSM8K format (`#### <number>`) rather than as an exact string.
GSM8K_FORMAT_SOURCES = frozenset({"rlpipe/word_problems"})


def builtin(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Judge of the built-in synthetic tasks (``rlpipe/<task>``): the tiny tasks' answers are exact strings,
    ``rlpipe/word_problems`` is scored by the strict ``gsm8k`` judge (the number after the last ``####``)."""
    if data_source in GSM8K_FORMAT_SOURCES:
        return gsm8k(data_source, solution_str, ground_truth, extra_info)
    return exact_match(data_source, solution_str, ground_truth, extra_info)


# ---------------------------------------------------------------------------------------------- numbers

_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")
_GSM8K_MARKER = "####"


def _to_number(text: str) -> float | None:
    """Parse ``'1,234.50'``/``'$12'``/``'7.'`` as a float; None if it is not a plain number."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not t or t in {"-", "."}:
        return None
    try:
        value = float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    x, y = _to_number(a), _to_number(b)
    if x is None or y is None:
        return False
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K-style solution.

    strict: the first whitespace-separated token after the last ``####`` marker (the GSM8K reference format),
    if it is a plain number (``1,234``, ``$18``, ``7.`` and ``-5`` are; ``12abc``, ``**7**`` and nothing are not:
    a malformed final answer scores 0 even when an earlier marker was well formed).
    flexible: the last number anywhere in the text (for models that do not emit the marker).
    Same two modes as verl's ``gsm8k.extract_solution``.
    """
    if method == "strict":
        if _GSM8K_MARKER not in solution_str:
            return None
        tail = solution_str.rsplit(_GSM8K_MARKER, 1)[1].split()
        if tail and tail[0] == "$" and len(tail) > 1:  # "#### $ 18"
            tail = tail[1:]
        return tail[0] if tail and _to_number(tail[0]) is not None else None
    if method == "flexible":
        found = [m for m in _NUMBER.findall(solution_str) if _to_number(m) is not None]
        return found[-1] if found else None
    raise ConfigError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")


def _gsm8k_truth(ground_truth: str) -> str:
    """Ground truth may be the bare number or a full GSM8K reference solution ending in ``#### n``."""
    gt = str(ground_truth)
    return extract_gsm8k_answer(gt, "strict") or gt


def gsm8k(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """GSM8K judge; ``extra_info={"method": "flexible"}`` switches from strict (default) to flexible extraction."""
    method = extra_info.get("method", "strict") if isinstance(extra_info, dict) else "strict"
    return float(_numbers_equal(extract_gsm8k_answer(solution_str, method), _gsm8k_truth(ground_truth)))


def gsm8k_flexible(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """GSM8K judge that takes the last number in the response."""
    return float(_numbers_equal(extract_gsm8k_answer(solution_str, "flexible"), _gsm8k_truth(ground_truth)))


# ---------------------------------------------------------------------------------------------- boxed math


_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s${}]+)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces; ``\\boxed 5`` also works.

    None when there is no box, or the last box is unbalanced (the response was cut off).
    """
    starts = [m.start() for m in re.finditer(r"\\(?:boxed|fbox)", text)]
    if not starts:
        return None
    start = starts[-1]
    opened = _BOXED_OPEN.match(text, start)
    if opened is None:
        bare = _BOXED_BARE.match(text, start)
        return bare.group(1) if bare else None
    depth = 0
    for j in range(opened.end() - 1, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[opened.end() : j]
    return None


def _strip_text_commands(s: str) -> str:
    return re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)


def normalize_math(answer: str) -> str:
    """Light normalisation so equal answers compare equal as strings (not a CAS).

    Removes ``$``, spaces, ``\\left``/``\\right``, ``\\!``/``\\,`` spacing, ``^\\circ``/degree signs, a trailing
    period, ``\\text{}`` wrappers and a leading ``x =``; maps ``\\dfrac``/``\\tfrac`` to ``\\frac``; drops
    thousands commas in plain numbers.
    """
    s = _strip_text_commands(answer.strip())
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac")):
        s = s.replace(old, new)
    s = s.replace("\\tfrac", "\\frac").replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = s.replace("$", "").replace(" ", "").rstrip(".")
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?", s):
        s = s.replace(",", "")
    return s


def math_answers_equal(a: str, b: str) -> bool:
    """Equal after ``normalize_math``, or numerically equal when both are plain numbers."""
    na, nb = normalize_math(a), normalize_math(b)
    return na == nb or _numbers_equal(na, nb)


def boxed_math(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """MATH-style judge: the last ``\\boxed{}`` of the response vs the ground truth (itself boxed or bare)."""
    pred = last_boxed(solution_str)
    if pred is None:
        return 0.0
    gt = str(ground_truth)
    truth = last_boxed(gt) if "\\boxed" in gt or "\\fbox" in gt else gt
    return float(truth is not None and math_answers_equal(pred, truth))


# ---------------------------------------------------------------------------------------------- dispatch

_MATH_SOURCES = ("math", "aime", "amc", "deepscaler", "numina", "olympiad", "minerva", "dapo")


def judge_name_for(data_source: str) -> str:
    """Which judge ``auto`` uses for a data_source (verl-style names)."""
    ds = data_source.lower()
    if ds == "openai/gsm8k" or ds.endswith("gsm8k") or ds in GSM8K_FORMAT_SOURCES:
        return "gsm8k"
    if ds.startswith("rlpipe/"):
        return "builtin"
    if any(k in ds for k in _MATH_SOURCES):
        return "boxed_math"
    return "exact_match"


def auto(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """Dispatch on data_source: gsm8k -> gsm8k, ``rlpipe/*`` -> builtin, math sets -> boxed_math, else exact."""
    return JUDGES[judge_name_for(data_source)](data_source, solution_str, ground_truth, extra_info)


JUDGES: dict[str, Judge] = {
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "boxed_math": boxed_math,
    "builtin": builtin,
    "auto": auto,
}


def get_judge(name: str) -> Judge:
    """Look up a judge by name; unknown names raise ConfigError listing the known ones."""
    try:
        return JUDGES[name]
    except KeyError:
        raise ConfigError(f"unknown judge {name!r}; known judges: {', '.join(sorted(JUDGES))}") from None


def score_generations(
    judge: Judge | str,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[str],
    extra_infos: Sequence[Any] | None = None,
) -> list[float]:
    """Score parallel lists (one entry per generation) with one judge."""
    fn = get_judge(judge) if isinstance(judge, str) else judge
    n = len(solutions)
    if not (len(data_sources) == len(ground_truths) == n) or (extra_infos is not None and len(extra_infos) != n):
        raise ConfigError("score_generations: data_sources, solutions, ground_truths, extra_infos differ in length")
    extras = extra_infos if extra_infos is not None else [None] * n
    return [float(fn(d, s, g, e)) for d, s, g, e in zip(data_sources, solutions, ground_truths, extras, strict=True)]


def filter_uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Keep mask ``[G]`` over groups ``rewards [G, n]``: False where every reward of a group is equal.

    Why: a group with identical rewards has zero group-relative advantage, so it adds no gradient signal but
    still costs compute (DAPO's dynamic sampling filter).
    """
    if rewards.dim() != 2:
        raise ConfigError(f"filter_uniform_groups expects rewards [G, n], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] == 0:
        return torch.zeros(rewards.shape[0], dtype=torch.bool)
    return (rewards != rewards[:, :1]).any(dim=1)
