"""Typed inputs/outputs of the Flyte tasks: the rollout batch table, checkpoints, sampler/loader state, metrics.

Each is a real Flyte type (not a pickle) so the UI shows it, caching can key on it and other tools can read it:
- `RolloutBatch`: a parquet StructuredDataset with the documented columns (docs/ARCHITECTURE.md "RolloutBatch");
- `Checkpoint`: a dataclass around the checkpoint directory (FlyteDirectory) plus the fields a reader needs without
  downloading it (step, iteration, experiment, the lineage manifest as JSON, the samplers' `SamplerState`, the same
  type `train_state.json` holds);
- metrics: a parquet StructuredDataset, one row per iteration (the same rows `rlpipe run` writes to metrics.jsonl).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, get_args, get_origin

import pandas as pd
import pyarrow as pa
from flytekit import kwtypes
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType
from flytekit.types.directory import FlyteDirectory
from flytekit.types.structured import StructuredDataset

from rlpipe.data.sampler import SamplerState
from rlpipe.rollout.batch import LOGPROB_COLUMNS, ROLLOUT_SCHEMA
from rlpipe.train.checkpoint import load_train_state
from rlpipe.train.lineage import read_manifest

PARQUET = "parquet"

ROLLOUT_BATCH_COLUMNS = kwtypes(
    group_id=int,
    sample_index=int,
    prompt_index=int,
    data_source=str,
    ground_truth=str,
    prompt_ids=list[int],
    response_ids=list[int],
    rollout_logprobs=list[float],
    finish_reason=str,
    response_text=str,
    reward=float,
    advantage=float,
)
"""Declared columns of a RolloutBatch (Flyte types; the parquet types are `ROLLOUT_ARROW_SCHEMA`). After the
logprob phase the table also holds `old_logprobs` and, with KL on, `ref_logprobs` (list<float32>, response-aligned);
they are extra columns, not declared, so one type serves both phases."""

RolloutBatch = Annotated[StructuredDataset, ROLLOUT_BATCH_COLUMNS, PARQUET]
"""The rollout batch as a Flyte StructuredDataset (parquet): the output type of `rollout`."""

SCORED_ROLLOUT_BATCH_COLUMNS = kwtypes(**ROLLOUT_BATCH_COLUMNS, old_logprobs=list[float])
ScoredRolloutBatch = Annotated[StructuredDataset, SCORED_ROLLOUT_BATCH_COLUMNS, PARQUET]
"""Output of `compute_logprobs`: the batch plus `old_logprobs` (and `ref_logprobs` when KL is on, undeclared)."""

AnyRolloutBatch = Annotated[StructuredDataset, PARQUET]
"""Input type of the phases that read a batch. Flyte reads only the declared columns of a typed StructuredDataset,
so inputs declare none: every column arrives (a batch with columns is assignable to it)."""

MetricsTable = Annotated[StructuredDataset, PARQUET]
"""One row per RL iteration: flat float metrics with an `iteration` column."""

ROLLOUT_ARROW_SCHEMA: pa.Schema = ROLLOUT_SCHEMA
"""Exact parquet schema of the declared columns (owned by rlpipe.rollout.batch)."""


def batch_to_arrow(batch: pd.DataFrame) -> pa.Table:
    """The batch as an arrow table cast to the documented schema (list<float32>, int64, ...), logprob columns kept."""
    schema = ROLLOUT_ARROW_SCHEMA
    for col in LOGPROB_COLUMNS:
        if col in batch.columns:
            schema = schema.append(pa.field(col, pa.list_(pa.float32())))
    return pa.Table.from_pandas(batch[schema.names], schema=schema, preserve_index=False)


def rollout_dataset(batch: pd.DataFrame) -> StructuredDataset:
    """Wrap a rollout batch for a task output."""
    return StructuredDataset(dataframe=batch_to_arrow(batch))


def open_rollout_batch(sd: StructuredDataset) -> pd.DataFrame:
    """Read a RolloutBatch input back into the DataFrame the pipeline phases take (list cells as Python lists)."""
    table = sd.open(pa.Table).all()
    frame = table.to_pandas()
    for name in table.column_names:
        if pa.types.is_list(table.schema.field(name).type):
            frame[name] = table.column(name).to_pylist()
    return frame


def metrics_dataset(rows: list[dict[str, float]]) -> StructuredDataset:
    """Metrics rows as a table; columns are the union of keys (missing values NaN), sorted, `iteration` first."""
    frame = pd.DataFrame(rows, dtype="float64")
    cols = sorted(frame.columns, key=lambda c: (c != "iteration", c))
    return StructuredDataset(dataframe=frame[cols] if cols else frame)


def table_rows(table: StructuredDataset) -> list[dict[str, float]]:
    """A metrics table back as rows. NaN cells stay (a metric can be NaN); `merge_metrics_row` lets none overwrite a
    value."""
    return table.open(pd.DataFrame).all().to_dict("records")


def merge_metrics_row(into: dict[str, float], row: dict[str, float]) -> None:
    """Merge `row` into `into`; a NaN never overwrites a value (in a table NaN also means "this row lacked it")."""
    for key, value in row.items():
        if not (isinstance(value, float) and math.isnan(value) and key in into):
            into[key] = value


@dataclass
class Checkpoint:
    """A complete checkpoint directory (rlpipe.train.checkpoint layout) and what a reader needs without opening it.

    `uri` is the canonical location under the checkpoint root (a path on a shared volume, or an object-store URI);
    `path` is the same files as Flyte moves them between tasks. `manifest` is the checkpoint's manifest.json (lineage: parent, data hashes, config hash, code version), so the
    lineage is browsable in any Flyte UI, open-source included, not only through Artifact lineage.
    """

    path: FlyteDirectory
    uri: str
    experiment: str
    step: int
    iteration: int
    manifest: str = "{}"
    sampler: SamplerState = field(default_factory=SamplerState)
    sft_sampler: SamplerState | None = None

    @classmethod
    def from_dir(cls, directory: str | Path, uri: str, check_complete: bool = True) -> Checkpoint:
        """Describe the checkpoint whose manifest and train state are in `directory`; `uri` is its canonical home."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        if check_complete and not manifest.complete:
            from rlpipe.errors import CheckpointError

            raise CheckpointError(f"{directory} is not a complete checkpoint (manifest says complete=false)")
        state = load_train_state(directory)
        return cls(
            path=FlyteDirectory(str(directory)),
            uri=str(uri),
            experiment=manifest.experiment,
            step=manifest.step,
            iteration=manifest.iteration,
            manifest=manifest.model_dump_json(),
            sampler=state.sampler or SamplerState(),
            sft_sampler=state.sft_sampler,
        )

    def manifest_dict(self) -> dict:
        return json.loads(self.manifest)


class CheckpointTransformer(DataclassTransformer):
    """flytekit's dataclass transformer for `Checkpoint`, with the literal type built once instead of per call.

    flytekit rebuilds a dataclass's JSON schema (mashumaro) in every `get_literal_type`, and calls it for every task
    interface that names a Checkpoint and for every `Checkpoint | None` value it converts: ~0.4 s at workflow import
    and ~0.07 s per segment, measured. Values and the literal type are exactly those of the stock transformer.
    """

    def __init__(self) -> None:
        super().__init__()
        self._literal_type: LiteralType | None = None

    @property
    def name(self) -> str:
        return "rlpipe-Checkpoint"

    @property
    def python_type(self) -> type:
        return Checkpoint

    def get_literal_type(self, t: type) -> LiteralType:
        base = get_args(t)[0] if get_origin(t) is Annotated else t  # flytekit drops a dataclass's annotations too
        if base is not Checkpoint:
            return super().get_literal_type(t)
        if self._literal_type is None:
            self._literal_type = super().get_literal_type(Checkpoint)
        return self._literal_type


TypeEngine.register(CheckpointTransformer())
