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
Example ``i`` of ``(task, seed)`` does not depend on ``n`` (the first ``k`` rows of a larger set are the rows of a
smaller one). Different seeds may repeat examples (``add`` has only 2500 distinct problems): use distinct seeds for
train and eval and accept some overlap, as with any tiny synthetic task.
"""

from __future__ import annotations

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
class SyntheticTask:
    """A task: its name, a one-line description, and a generator ``rng -> (prompt text, answer)``."""

    name: str
    description: str
    generate: Callable[[random.Random], tuple[str, str]]

    @property
    def data_source(self) -> str:
        return f"rlpipe/{self.name}"


def _reverse(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice(DIGITS) for _ in range(rng.randint(3, 5)))
    return f"reverse {digits}", digits[::-1]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"add {a}+{b}", str(a + b)


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"sum {a}+{b}", str(a + b)


def _count(rng: random.Random) -> tuple[str, str]:
    letter = rng.choice(COUNT_ALPHABET)
    word = "".join(rng.choice(COUNT_ALPHABET) for _ in range(rng.randint(4, 8)))
    return f"count {letter} in {word}", str(word.count(letter))


BUILTIN_TASKS: dict[str, SyntheticTask] = {
    t.name: t
    for t in (
        SyntheticTask("reverse", "reverse a string of 3-5 digits", _reverse),
        SyntheticTask("add", "sum of two integers in 0..49", _add),
        SyntheticTask("sum", "sum of two digits (100 facts: a tiny model can learn them all)", _sum),
        SyntheticTask("count", "occurrences of a letter in a 4-8 letter word over 'abcde'", _count),
    )
}


def builtin_charset() -> str:
    """All characters the built-in tasks can produce (sorted, no duplicates): space, ``+-=?``, digits, a-z."""
    return _CHARSET


def task_names() -> list[str]:
    """Valid ``task`` arguments: the registry plus ``mix``."""
    return [*BUILTIN_TASKS, MIX_TASK]


def generate_examples(task: str, n: int, seed: int) -> list[tuple[SyntheticTask, str, str]]:
    """``n`` (task, prompt, answer) triples for ``(task, seed)``; example ``i`` uses its own seeded RNG."""
    if task not in BUILTIN_TASKS and task != MIX_TASK:
        raise ConfigError(f"unknown built-in task {task!r}; choose one of {task_names()}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"n must be a non-negative integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    pool = list(BUILTIN_TASKS.values())
    out = []
    for i in range(n):
        rng = random.Random(f"rlpipe/{task}/{seed}/{i}")  # str seeds hash with sha512: stable across runs/versions
        spec = rng.choice(pool) if task == MIX_TASK else BUILTIN_TASKS[task]
        prompt, answer = spec.generate(rng)
        out.append((spec, prompt, answer))
    return out


def make_task_rows(task: str, n: int, seed: int) -> list[dict[str, Any]]:
    """RL rows in the verl schema: chat ``prompt``, ``ground_truth`` (also as ``reward_model.ground_truth`` for
    verl), ``data_source`` and ``extra_info: {"index": i}``."""
    return [
        {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "ground_truth": answer,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"index": i},
        }
        for i, (spec, prompt, answer) in enumerate(generate_examples(task, n, seed))
    ]


def make_sft_rows(task: str, n: int, seed: int) -> list[dict[str, Any]]:
    """SFT rows: the same chat ``prompt`` as ``make_task_rows`` and ``response`` = the answer."""
    return [
        {
            "data_source": spec.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "response": answer,
            "extra_info": {"index": i},
        }
        for i, (spec, prompt, answer) in enumerate(generate_examples(task, n, seed))
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


def write_task_dataset(task: str, n: int, seed: int, path: str | Path, *, kind: Literal["rl", "sft"] = "rl") -> Path:
    """Generate ``n`` rows of ``task`` (RL prompts, or SFT pairs with ``kind="sft"``) and write them to ``path``."""
    if kind not in ("rl", "sft"):
        raise ConfigError(f"kind must be 'rl' or 'sft', got {kind!r}")
    rows = make_task_rows(task, n, seed) if kind == "rl" else make_sft_rows(task, n, seed)
    return write_rows(rows, path)
