"""Built-in synthetic verifiable tasks, generated deterministically from a seed (no data set ships in a package).

They are sized for a ~1M-parameter character-level model on CPU: prompts of at most ~20 characters, answers of at
most 5, and a small character set (``builtin_charset()``). The ground truth is exactly the expected answer string,
so an exact-match judge scores them; ``data_source`` is ``rlpipe/<task>``.

| task      | prompt example       | answer  |
|-----------|----------------------|---------|
| reverse   | ``reverse 4821``     | ``1284`` (3-5 digits, leading zeros kept)          |
| add       | ``add 12+7``         | ``19``   (a, b uniform in 0..49)                    |
| count     | ``count a in bacab`` | ``2``    (letter and 4-8 letter word from ``abcde``) |

``mix`` draws one of the tasks above per example (uniformly), keeping each example's own ``data_source``.

``word_problems`` is not sized for the tiny model: GSM8K-style arithmetic stories (1-3 steps, integer answers)
for a pretrained instruct model, answered as ``#### <number>`` and scored by the ``gsm8k`` judge (see
``rlpipe.data.word_problems``). It is not part of ``mix``, and its train and eval splits are disjoint by
construction.
Example ``i`` of ``(task, seed)`` does not depend on ``n`` (the first ``k`` rows of a larger set are the rows of a
smaller one). Different seeds may repeat examples (``add`` has only 2500 distinct problems): use distinct seeds for
train and eval and accept some overlap, as with any tiny synthetic task.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.data.reading import file_format
from rlpipe.errors import ConfigError

DIGITS = "0123456789"
COUNT_ALPHABET = "abcde"
# Every character any built-in task may emit, plus a few spare symbols so new tasks do not change the vocabulary.
_CHARSET = " +-0123456789=?abcdefghijklmnopqrstuvwxyz"
MIX_TASK = "mix"


@dataclass(frozen=True)
class TaskExample:
    """One generated example: prompt text, ground-truth answer, the SFT demonstration (default: the answer) and
    the key that decides its split (default: the prompt)."""

    prompt: str
    answer: str
    demonstration: str | None = None
    split_key: str | None = None

    @property
    def response(self) -> str:
        return self.answer if self.demonstration is None else self.demonstration


@dataclass(frozen=True)
class SyntheticTask:
    """A task: its name, a one-line description, and a generator ``rng -> TaskExample``.

    ``disjoint_splits``: the eval split holds only problems whose ``split_key`` hashes into the held-out bucket and
    the train split only the others, so no eval problem is ever trained on. ``tiny``: fits the tiny char model (its
    charset and lengths); only tiny tasks are drawn by ``mix`` or used to warm-start the tiny model.
    """

    name: str
    description: str
    generate: Callable[[random.Random], TaskExample]
    disjoint_splits: bool = False
    tiny: bool = True

    @property
    def data_source(self) -> str:
        return f"rlpipe/{self.name}"


def _reverse(rng: random.Random) -> TaskExample:
    digits = "".join(rng.choice(DIGITS) for _ in range(rng.randint(3, 5)))
    return TaskExample(f"reverse {digits}", digits[::-1])


def _add(rng: random.Random) -> TaskExample:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return TaskExample(f"add {a}+{b}", str(a + b))


def _sum(rng: random.Random) -> TaskExample:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return TaskExample(f"sum {a}+{b}", str(a + b))


def _count(rng: random.Random) -> TaskExample:
    letter = rng.choice(COUNT_ALPHABET)
    word = "".join(rng.choice(COUNT_ALPHABET) for _ in range(rng.randint(4, 8)))
    return TaskExample(f"count {letter} in {word}", str(word.count(letter)))


# ---------------------------------------------------------------------------------------------- word problems

WORD_PROBLEMS = "word_problems"
WORD_PROBLEM_INSTRUCTION = (
    "Answer with the calculation in one short line, then the final number on the last line in the form '#### <number>'."
)
HELD_OUT_BUCKETS = 5  # 1 in 5 problem keys belongs to the eval split
_NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jill", "Kofi", "Lena", "Mia", "Noah",
          "Omar", "Pia", "Raj", "Sam", "Tara", "Uma", "Vic", "Wes", "Yuki", "Zoe")  # fmt: skip
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "balloons")


@dataclass(frozen=True)
class _Story:
    template: str
    text: str
    answer: int
    numbers: tuple[int, ...]
    steps: tuple[str, ...]  # the worked solution, one equation per step


Rand = Callable[[int, int], int]  # random.Random.randint


def _t_add(r: Rand, n: str, o: str, it: str) -> _Story:
    a, b = r(2, 20), r(2, 20)
    text = f"{n} has {a} {it}. {o} gives {n} {b} more. How many {it} does {n} have now?"
    return _Story("add", text, a + b, (a, b), (f"{a} + {b} = {a + b}",))


def _t_sub(r: Rand, n: str, o: str, it: str) -> _Story:
    a = r(6, 30)
    b = r(2, a - 1)
    text = f"{n} has {a} {it} and gives {b} of them to {o}. How many {it} does {n} have left?"
    return _Story("sub", text, a - b, (a, b), (f"{a} - {b} = {a - b}",))


def _t_mul(r: Rand, n: str, o: str, it: str) -> _Story:
    a, b = r(2, 6), r(2, 6)
    text = f"{n} buys {a} boxes of {it}. Each box holds {b} {it}. How many {it} does {n} buy?"
    return _Story("mul", text, a * b, (a, b), (f"{a} * {b} = {a * b}",))


def _t_div(r: Rand, n: str, o: str, it: str) -> _Story:
    q, b = r(2, 6), r(2, 6)
    text = f"{n} shares {q * b} {it} equally among {b} friends. How many {it} does each friend get?"
    return _Story("div", text, q, (q * b, b), (f"{q * b} / {b} = {q}",))


def _t_add_mul(r: Rand, n: str, o: str, it: str) -> _Story:
    a, b, c = r(2, 10), r(2, 4), r(2, 5)
    text = f"{n} has {a} {it}. {n} buys {b} packs with {c} {it} in each pack. How many {it} does {n} have now?"
    return _Story("add_mul", text, a + b * c, (a, b, c), (f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}"))


def _t_sub_add(r: Rand, n: str, o: str, it: str) -> _Story:
    a = r(6, 20)
    b, c = r(2, a - 1), r(2, 10)
    text = f"{n} has {a} {it}, gives {b} to {o}, and then finds {c} more. How many {it} does {n} have now?"
    return _Story("sub_add", text, a - b + c, (a, b, c), (f"{a} - {b} = {a - b}", f"{a - b} + {c} = {a - b + c}"))


def _t_more_than(r: Rand, n: str, o: str, it: str) -> _Story:
    a, b = r(2, 10), r(2, 10)
    text = f"{n} has {a} {it}. {o} has {b} more {it} than {n}. How many {it} do they have together?"
    return _Story("more_than", text, 2 * a + b, (a, b), (f"{a} + {b} = {a + b}", f"{a} + {a + b} = {2 * a + b}"))


def _t_mul_add_sub(r: Rand, n: str, o: str, it: str) -> _Story:
    a, b, c = r(2, 10), r(2, 4), r(2, 5)
    total = a + b * c
    d = r(1, total - 1)
    text = (f"{n} has {a} {it}. {n} buys {b} packs with {c} {it} in each pack, then gives {d} {it} to {o}. "
            f"How many {it} does {n} have left?")  # fmt: skip
    steps = (f"{b} * {c} = {b * c}", f"{a} + {b * c} = {total}", f"{total} - {d} = {total - d}")
    return _Story("mul_add_sub", text, total - d, (a, b, c, d), steps)


# 4 one-step, 3 two-step and 1 three-step templates, drawn uniformly.
_TEMPLATES = (_t_add, _t_sub, _t_mul, _t_div, _t_add_mul, _t_sub_add, _t_more_than, _t_mul_add_sub)


def _word_problem(rng: random.Random) -> TaskExample:
    """A story plus the answer-format instruction; the demonstration is the worked steps and ``#### <answer>``.

    The split key is the template and its numbers (names and items do not count: a renamed eval problem is still
    held out).
    """
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    story = rng.choice(_TEMPLATES)(rng.randint, name, other, item)
    return TaskExample(
        prompt=f"{story.text}\n{WORD_PROBLEM_INSTRUCTION}",
        answer=str(story.answer),
        demonstration="\n".join(story.steps) + f"\n#### {story.answer}",
        split_key=f"{story.template}:{','.join(map(str, story.numbers))}",
    )


def split_of(split_key: str) -> Literal["train", "eval"]:
    """Which split a problem belongs to: a stable hash (sha256) of its key, 1 in ``HELD_OUT_BUCKETS`` held out."""
    bucket = int(hashlib.sha256(split_key.encode()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS
    return "eval" if bucket == 0 else "train"


BUILTIN_TASKS: dict[str, SyntheticTask] = {
    t.name: t
    for t in (
        SyntheticTask("reverse", "reverse a string of 3-5 digits", _reverse),
        SyntheticTask("add", "sum of two integers in 0..49", _add),
        SyntheticTask("sum", "sum of two digits (100 facts: a tiny model can learn them all)", _sum),
        SyntheticTask("count", "occurrences of a letter in a 4-8 letter word over 'abcde'", _count),
        SyntheticTask(
            WORD_PROBLEMS,
            "GSM8K-style arithmetic stories, 1-3 steps, answered as '#### n'",
            _word_problem,
            disjoint_splits=True,
            tiny=False,
        ),  # fmt: skip
    )
}


def builtin_charset() -> str:
    """All characters the built-in tasks can produce (sorted, no duplicates): space, ``+-=?``, digits, a-z."""
    return _CHARSET


def task_names() -> list[str]:
    """Valid ``task`` arguments: the registry plus ``mix``."""
    return [*BUILTIN_TASKS, MIX_TASK]


def tiny_task_names() -> list[str]:
    """Tasks the tiny char model can be built for (its charset, short prompts), plus ``mix`` of them."""
    return [*(t.name for t in BUILTIN_TASKS.values() if t.tiny), MIX_TASK]


Split = Literal["train", "eval"]
_MAX_DRAWS = 1000  # rejection draws for a split before giving up (the held-out share is 1/5: never reached)


def _draw(spec: SyntheticTask, rng: random.Random, split: Split) -> TaskExample:
    """One example of ``spec`` in ``split``: tasks with disjoint splits redraw until the key falls in it."""
    for _ in range(_MAX_DRAWS):
        ex = spec.generate(rng)
        if not spec.disjoint_splits or split_of(ex.split_key or ex.prompt) == split:
            return ex
    raise RuntimeError(f"task {spec.name!r}: no {split} example in {_MAX_DRAWS} draws")  # pragma: no cover


def generate_examples(task: str, n: int, seed: int, split: Split = "train") -> list[tuple[SyntheticTask, TaskExample]]:
    """``n`` (task, example) pairs for ``(task, seed, split)``; example ``i`` uses its own seeded RNG.

    ``split`` matters only for tasks with ``disjoint_splits`` (``word_problems``); the tiny tasks keep separating
    train and eval by seed alone.
    """
    if task not in BUILTIN_TASKS and task != MIX_TASK:
        raise ConfigError(f"unknown built-in task {task!r}; choose one of {task_names()}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    if split not in ("train", "eval"):
        raise ConfigError(f"split must be 'train' or 'eval', got {split!r}")
    pool = [t for t in BUILTIN_TASKS.values() if t.tiny]
    out = []
    for i in range(n):
        rng = random.Random(f"rlpipe/{task}/{seed}/{i}")  # str seeds hash with sha512: stable across runs/versions
        spec = rng.choice(pool) if task == MIX_TASK else BUILTIN_TASKS[task]
        out.append((spec, _draw(spec, rng, split)))
    return out


def make_task_rows(task: str, n: int, seed: int, split: Split = "train") -> list[dict[str, Any]]:
    """RL rows in the verl schema: chat ``prompt``, ``ground_truth`` (also as ``reward_model.ground_truth`` for
    verl), ``data_source`` and ``extra_info: {"index": i}``."""
    return [
        {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": ex.prompt}],
            "ground_truth": ex.answer,
            "reward_model": {"style": "rule", "ground_truth": ex.answer},
            "extra_info": {"index": i},
        }
        for i, (spec, ex) in enumerate(generate_examples(task, n, seed, split))
    ]


def make_sft_rows(task: str, n: int, seed: int, split: Split = "train") -> list[dict[str, Any]]:
    """SFT rows: the same chat ``prompt`` as ``make_task_rows`` and ``response`` = the demonstration (the bare
    answer for the tiny tasks, a worked solution ending in ``#### n`` for ``word_problems``)."""
    return [
        {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": ex.prompt}],
            "response": ex.response,
            "extra_info": {"index": i},
        }
        for i, (spec, ex) in enumerate(generate_examples(task, n, seed, split))
    ]


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to parquet or jsonl (by suffix) atomically: temp file in the same dir, fsync, rename."""
    path = Path(path)
    fmt = file_format(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if fmt == "parquet":
                pq.write_table(pa.Table.from_pylist(rows), fh)
            else:
                for row in rows:
                    fh.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_task_dataset(
    task: str, n: int, seed: int, path: str | Path, *, kind: Literal["rl", "sft"] = "rl", split: Split = "train"
) -> Path:
    """Generate ``n`` rows of ``task`` (RL prompts, or SFT pairs with ``kind="sft"``) and write them to ``path``."""
    if kind not in ("rl", "sft"):
        raise ConfigError(f"kind must be 'rl' or 'sft', got {kind!r}")
    rows = make_task_rows(task, n, seed, split) if kind == "rl" else make_sft_rows(task, n, seed, split)
    return write_rows(rows, path)
