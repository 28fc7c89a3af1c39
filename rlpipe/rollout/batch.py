"""The RolloutBatch table: generations + rewards + group-relative advantages, as a pandas DataFrame / parquet.

Columns (docs/ARCHITECTURE.md): group_id, sample_index, prompt_index, data_source, ground_truth, prompt_ids,
response_ids, rollout_logprobs, finish_reason, reward, advantage; later old_logprobs / ref_logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlpipe.algos.advantages import compute_advantages
from rlpipe.data.datasets import PromptExample
from rlpipe.data.packing import SequenceItem
from rlpipe.errors import DataError
from rlpipe.rollout.engine import Generation

ROLLOUT_SCHEMA = pa.schema(
    [
        ("group_id", pa.int64()),
        ("sample_index", pa.int64()),
        ("prompt_index", pa.int64()),
        ("data_source", pa.string()),
        ("ground_truth", pa.string()),
        ("prompt_ids", pa.list_(pa.int64())),
        ("response_ids", pa.list_(pa.int64())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("response_text", pa.string()),
        ("reward", pa.float32()),
        ("advantage", pa.float32()),
    ]
)
LOGPROB_COLUMNS = ("old_logprobs", "ref_logprobs")


def score_generations(
    examples: Sequence[PromptExample],
    generations: Sequence[Generation],
    decode: Callable[[list[int]], str],
    judge: Callable[[str, str, str, dict], float],
) -> tuple[list[str], np.ndarray]:
    """Decode each response and score it with the judge (verl signature); non-finite rewards are an error."""
    texts, rewards = [], []
    for gen in generations:
        ex = examples[gen.prompt_index]
        text = decode(gen.response_ids)
        reward = float(judge(ex.data_source, text, ex.ground_truth, ex.extra_info))
        if not np.isfinite(reward):
            raise DataError(f"judge returned a non-finite reward {reward}", row=ex.row, field="reward")
        texts.append(text)
        rewards.append(reward)
    return texts, np.asarray(rewards, dtype=np.float32)


def build_rollout_batch(
    examples: Sequence[PromptExample],
    generations: Sequence[Generation],
    texts: Sequence[str],
    rewards: np.ndarray,
    n: int,
    advantage: str,
    advantage_kwargs: dict | None = None,
    filter_uniform_groups: bool = False,
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Group rewards by prompt ([G, n]), compute advantages, optionally drop no-signal groups; returns batch + stats."""
    if len(generations) != len(examples) * n:
        raise DataError(
            f"expected {len(examples) * n} generations ({len(examples)} prompts x n={n}), got {len(generations)}"
        )
    order = sorted(range(len(generations)), key=lambda i: (generations[i].prompt_index, generations[i].sample_index))
    gens = [generations[i] for i in order]
    texts = [texts[i] for i in order]
    grouped = torch.as_tensor(rewards[order], dtype=torch.float32).reshape(len(examples), n)
    lengths = torch.tensor([len(g.response_ids) for g in gens], dtype=torch.float32).reshape(len(examples), n)
    adv = compute_advantages(advantage, grouped, lengths=lengths, **(advantage_kwargs or {}))
    uniform = (grouped == grouped[:, :1]).all(dim=1)
    keep = ~uniform if filter_uniform_groups else torch.ones(len(examples), dtype=torch.bool)
    kept = [i for i in range(len(gens)) if keep[i // n]]
    flat_rewards, flat_adv = grouped.reshape(-1).tolist(), adv.reshape(-1).tolist()
    picked = [(gens[i], examples[gens[i].prompt_index]) for i in kept]
    columns = {  # built column by column: the driver does this every iteration, row dicts cost ~3x more
        "group_id": [i // n for i in kept],
        "sample_index": [g.sample_index for g, _ in picked],
        "prompt_index": [ex.row for _, ex in picked],
        "data_source": [ex.data_source for _, ex in picked],
        "ground_truth": [ex.ground_truth for _, ex in picked],
        "prompt_ids": [list(ex.prompt_ids) for _, ex in picked],
        "response_ids": [list(g.response_ids) for g, _ in picked],
        "rollout_logprobs": [[float(x) for x in g.logprobs] for g, _ in picked],
        "finish_reason": [g.finish_reason for g, _ in picked],
        "response_text": [texts[i] for i in kept],
        "reward": [flat_rewards[i] for i in kept],
        "advantage": [flat_adv[i] for i in kept],
    }
    stats = {
        "reward_mean": float(grouped.mean()),
        "reward_std": float(grouped.std(unbiased=False)),
        "reward_max": float(grouped.max()),
        "pass_at_n": float((grouped.max(dim=1).values > 0).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "truncated_fraction": float(np.mean([g.finish_reason == "length" for g in gens])),
        "uniform_group_fraction": float(uniform.float().mean()),
        "kept_groups": float(keep.sum()),
    }
    frame = pd.DataFrame(columns, columns=ROLLOUT_SCHEMA.names)
    return frame, stats


def batch_to_items(batch: pd.DataFrame) -> list[SequenceItem]:
    """One SequenceItem per row (row = position in the frame), ready for packing."""
    columns = zip(
        _lists(batch["prompt_ids"]), _lists(batch["response_ids"]), batch["advantage"].tolist(),
        _lists(batch["rollout_logprobs"]), strict=True,
    )  # fmt: skip
    return [
        SequenceItem(
            prompt_ids=[int(x) for x in p],
            response_ids=[int(x) for x in r],
            advantage=float(a),
            rollout_logprobs=[float(x) for x in lp],
            row=row,
        )  # fmt: skip
        for row, (p, r, a, lp) in enumerate(columns)
    ]


def _lists(column: pd.Series) -> list:
    """A list-valued column as Python lists (numpy arrays after a parquet round trip, lists when built here)."""
    return [list(v) for v in column.tolist()]


def write_batch(batch: pd.DataFrame, path: str | Path) -> None:
    """Parquet with the documented schema (plus logprob columns when present)."""
    if len(batch) == 0:  # every group filtered out: pandas types the empty columns float64, arrow refuses lists
        batch = batch.astype(object)
    schema = ROLLOUT_SCHEMA
    for col in LOGPROB_COLUMNS:
        if col in batch.columns:
            schema = schema.append(pa.field(col, pa.list_(pa.float32())))
    pq.write_table(pa.Table.from_pandas(batch, schema=schema, preserve_index=False), str(path))


def read_batch(path: str | Path) -> pd.DataFrame:
    """Read a RolloutBatch parquet; a missing column is a DataError naming it."""
    try:
        frame = pq.read_table(str(path)).to_pandas()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read rollout batch: {exc}", file=str(path)) from exc
    missing = [c for c in ROLLOUT_SCHEMA.names if c not in frame.columns]
    if missing:
        raise DataError(f"rollout batch lacks columns {missing}", file=str(path), field=missing[0])
    return frame
