"""One Flyte task per phase: thin typed wrappers around `rlpipe.phases` (no math here).

Ray phases (rollout, logprobs, train, sft, evaluate, export) run as RayJobs; light bookkeeping runs as plain tasks.
Every task takes the config as the validated JSON string `resolve_config` produced, so a run's exact config is an
input visible in the UI and part of every cache key.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, NamedTuple

from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from rlpipe import phases
from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config, parse_override
from rlpipe.train.lineage import read_manifest
from tasks import storage
from tasks.artifacts import CheckpointArtifact, HFModelArtifact, MetricsArtifact, RolloutBatchArtifact, tag
from tasks.common import (
    CACHE,
    checkpoint_metrics_history,
    cpu_task,
    decode_config,
    engine_config,
    env_defaults,
    ray_task,
    resumable,
)
from tasks.decks import TrainingDecks
from tasks.errors import retry_on_lost_workers
from tasks.types import (
    AnyRolloutBatch,
    Checkpoint,
    MetricsTable,
    RolloutBatch,
    ScoredRolloutBatch,
    merge_metrics_row,
    metrics_dataset,
    open_rollout_batch,
    rollout_dataset,
    table_rows,
)

env_defaults()

RETRIES = 2
"""Retries of Ray phases; only recoverable failures (lost actor/node, FlyteRecoverableException) use them."""


@cpu_task(timeout=timedelta(minutes=5))
def resolve_config(config_file: FlyteFile | None = None, overrides: list[str] | None = None, engine: str = "") -> str:
    """Validate the YAML config (None = the built-in defaults) plus `key=value` overrides into one JSON string;
    `engine` (hf, vllm, sglang, openai; "" = the config's) sets `rollout.engine` after the overrides."""
    path = config_file.download() if config_file is not None else None
    values = dict(parse_override(o) for o in (overrides or []))
    if engine:
        values["rollout.engine"] = engine
    cfg = load_config(path, values)
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True)


@cpu_task(timeout=timedelta(hours=1), retries=RETRIES)
def base_model(config: str, model_dir: FlyteDirectory | None = None) -> FlyteDirectory:
    """The policy every phase starts from: `model_dir`, `model.path`, or the tiny default built and warm-started.

    Not Flyte-cached: a local run's output is a path under `output_dir`, and the local cache would hand that path to
    the next run even from another checkout or after `runs/` was deleted ("... is not a directory"). Repeats are
    cheap anyway: `prepare_base_model` reuses a built model by its content fingerprint, and a `model.path` URI is
    passed through without a copy.
    """
    env_defaults()
    cfg = decode_config(config)
    if model_dir is not None:
        cfg.model.path = str(model_dir.download())
    elif cfg.model.path is not None and storage.is_uri(cfg.model.path):
        return FlyteDirectory(cfg.model.path)
    return FlyteDirectory(prepare_base_model(cfg))


@cpu_task(timeout=timedelta(minutes=10))
def start_point(config: str, checkpoint: str = "", resume: bool = False) -> Checkpoint | None:
    """Where a run starts: an explicit checkpoint (path or URI), else with `resume` the newest complete checkpoint
    of the experiment under `checkpoint.root`, else None (the base model)."""
    if checkpoint:
        return storage.describe(checkpoint)
    if resume:
        latest = storage.resume_location(decode_config(config))  # refuses a step dir that is not a checkpoint
        return storage.describe(latest) if latest else None
    return None


class RolloutOut(NamedTuple):
    batch: Annotated[RolloutBatch, RolloutBatchArtifact()]
    metrics: dict[str, float]


@ray_task(cache=CACHE, retries=RETRIES, timeout=timedelta(hours=1))
def rollout(config: str, base_model: FlyteDirectory, checkpoint: Checkpoint | None, iteration: int) -> RolloutOut:
    """Sample, judge and score the next prompts with the checkpoint's policy (deterministic for a fixed seed)."""
    user, cfg, _ = engine_config(config, base_model)
    with retry_on_lost_workers("rollout"):
        batch, stats = phases.rollout(cfg, storage.materialize(checkpoint), iteration)
    stats["iteration"] = float(iteration)
    sd = tag(RolloutBatchArtifact, rollout_dataset(batch), user.experiment, iteration)
    return RolloutOut(batch=sd, metrics=stats)


@ray_task(cache=CACHE, retries=RETRIES, timeout=timedelta(hours=1))
def compute_logprobs(
    config: str, base_model: FlyteDirectory, checkpoint: Checkpoint | None, batch: AnyRolloutBatch, iteration: int
) -> Annotated[ScoredRolloutBatch, RolloutBatchArtifact()]:
    """Add old-policy (and, with KL on, reference) logprobs to the batch."""
    user, cfg, _ = engine_config(config, base_model)
    with retry_on_lost_workers("compute_logprobs"):
        out = phases.compute_logprobs(cfg, storage.materialize(checkpoint), open_rollout_batch(batch))
    return tag(RolloutBatchArtifact, rollout_dataset(out), user.experiment, iteration)


class TrainOut(NamedTuple):
    checkpoint: Annotated[Checkpoint, CheckpointArtifact()]
    metrics: dict[str, float]


def _finish(user, ckpt: Checkpoint, row: dict[str, float], title: str) -> TrainOut:
    decks = TrainingDecks(title, rows=checkpoint_metrics_history(ckpt.uri)[:-1])
    decks.add(row)
    decks.set_lineage(ckpt.uri)
    decks.publish()
    return TrainOut(checkpoint=tag(CheckpointArtifact, ckpt, user.experiment, ckpt.step), metrics=row)


@ray_task(retries=RETRIES, timeout=timedelta(hours=2), enable_deck=True)
def train(
    config: str,
    base_model: FlyteDirectory,
    checkpoint: Checkpoint | None,
    batch: AnyRolloutBatch,
    iteration: int,
    rollout_metrics: dict[str, float] | None = None,
) -> TrainOut:
    """One RL update on the batch; a retry returns the checkpoint an earlier attempt already completed."""
    user, cfg, remote = engine_config(config, base_model)
    done = resumable(user, checkpoint, iteration)
    if done is not None:
        ckpt = storage.describe(done)
        metrics = dict(read_manifest(done).metrics)
    else:
        local = storage.materialize(checkpoint)
        with retry_on_lost_workers("train"):
            path, metrics = phases.train(cfg, local, open_rollout_batch(batch), iteration)
        ckpt = storage.publish(path, cfg, remote, {local: checkpoint.uri} if local and checkpoint else None)
    row = {**(rollout_metrics or {}), **metrics, "iteration": float(iteration)}
    return _finish(user, ckpt, row, f"{user.experiment}: train @ iteration {iteration}")


@ray_task(retries=RETRIES, timeout=timedelta(hours=1), enable_deck=True)
def sft(config: str, base_model: FlyteDirectory, checkpoint: Checkpoint, iteration: int) -> TrainOut:
    """One SFT step on the SFT data (run after the RL iterations where it is due)."""
    user, cfg, remote = engine_config(config, base_model)
    local = storage.materialize(checkpoint)
    with retry_on_lost_workers("sft"):
        path, metrics = phases.sft(cfg, local, iteration)
    ckpt = storage.publish(path, cfg, remote, {local: checkpoint.uri})
    return _finish(user, ckpt, {**metrics, "iteration": float(iteration)}, f"{user.experiment}: sft @ {iteration}")


@ray_task(cache=CACHE, retries=RETRIES, timeout=timedelta(hours=1))
def evaluate(
    config: str, base_model: FlyteDirectory, checkpoint: Checkpoint | None, iteration: int
) -> dict[str, float]:
    """Greedy reward on held-out prompts."""
    _, cfg, _ = engine_config(config, base_model)
    with retry_on_lost_workers("evaluate"):
        out = phases.evaluate(cfg, storage.materialize(checkpoint))
    return {**out, "iteration": float(iteration)}


@ray_task(retries=RETRIES, timeout=timedelta(hours=1))
def export_hf(
    config: str, base_model: FlyteDirectory, checkpoint: Checkpoint
) -> Annotated[FlyteDirectory, HFModelArtifact()]:
    """Safetensors + tokenizer in HF layout (AutoModelForCausalLM, vLLM, SGLang load it).

    Not Flyte-cached: the export is written to a fresh temp dir; on a cluster Flyte uploads it to the raw output
    store, but a local run keeps the local path, and a cache hit would hand a later run a dir that no longer exists.
    An export is one weight load and save (seconds), so it simply runs again.
    """
    import tempfile

    user, cfg, _ = engine_config(config, base_model)
    out_dir = tempfile.mkdtemp(prefix="rlpipe-hf-")
    with retry_on_lost_workers("export_hf"):
        phases.export_hf(cfg, storage.materialize(checkpoint), out_dir)
    return tag(HFModelArtifact, FlyteDirectory(out_dir), user.experiment, checkpoint.step)


@cpu_task(timeout=timedelta(minutes=10))
def metrics_table(
    config: str, rows: list[dict[str, float]] | None = None, tables: list[MetricsTable] | None = None
) -> Annotated[MetricsTable, MetricsArtifact()]:
    """Metrics rows (granular: one per phase task) and tables (one per segment) as one table, one row per
    iteration: rows of the same `iteration` merged (rollout + train + sft + eval), sorted by iteration.

    Segments pass tables, not rows: Flyte converts a `dict[str, float]` value by value, which for 100 rows of ~40
    metrics per segment cost seconds per run; a parquet table is one file."""
    merged: dict[float, dict[str, float]] = {}
    for row in [*(rows or []), *(r for t in tables or [] for r in table_rows(t))]:
        merge_metrics_row(merged.setdefault(row.get("iteration", float("nan")), {}), row)
    ordered = [merged[k] for k in sorted(merged)]
    last = int(max(merged)) if merged else 0
    return tag(MetricsArtifact, metrics_dataset(ordered), decode_config(config).experiment, last)
