"""`rl_segment`: k RL iterations in one Ray job with the weights resident (the fast path of the `grpo` workflow).

A retry (a Ray actor or node was lost: FlyteRecoverableException) resumes from the newest complete checkpoint this
chain left under the checkpoint root (set `checkpoint.every` to checkpoint inside a segment), and runs only the
iterations still missing, so a retried segment ends where an uninterrupted one would.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, NamedTuple

from flytekit.types.directory import FlyteDirectory

from rlpipe import loop
from rlpipe.train.lineage import lineage_chain, read_manifest
from tasks import storage
from tasks.artifacts import CheckpointArtifact, tag
from tasks.common import checkpoint_metrics_history, engine_config, env_defaults, ray_task, resumable
from tasks.decks import TrainingDecks
from tasks.errors import retry_on_lost_workers
from tasks.types import Checkpoint, MetricsTable, metrics_dataset

env_defaults()

SEGMENT_RETRIES = 3
DECK_PUBLISH_EVERY_S = 60.0
PROGRESS_EVERY = 10  # iterations between two progress lines in the task log


class SegmentOut(NamedTuple):
    checkpoint: Annotated[Checkpoint, CheckpointArtifact()]
    metrics: MetricsTable


@ray_task(retries=SEGMENT_RETRIES, timeout=timedelta(hours=6), enable_deck=True)
def rl_segment(config: str, base_model: FlyteDirectory, checkpoint: Checkpoint | None, k: int) -> SegmentOut:
    """Run up to `k` iterations from `checkpoint` (None = base model), capped at `iterations` of the config."""
    user, cfg, remote = engine_config(config, base_model)
    start_iteration = checkpoint.iteration if checkpoint else 0
    target = min(start_iteration + k, user.iterations)
    resumed = resumable(user, checkpoint, target)
    if resumed is not None:
        origin = storage.describe(resumed)
        print(f"rl_segment: resuming from {resumed} (iteration {origin.iteration}) left by an earlier attempt")
    else:
        origin = checkpoint
    local = storage.materialize(origin)
    aliases = {local: origin.uri} if local and origin else {}
    title = f"{user.experiment}: segment, iterations {start_iteration + 1}..{target}"
    decks = TrainingDecks(title, publish_every_s=DECK_PUBLISH_EVERY_S, rows=_history(origin))
    published: list[str] = []

    def on_iteration(row: dict[str, float]) -> None:
        decks.add(row)
        if int(row["iteration"]) % PROGRESS_EVERY == 0 or int(row["iteration"]) == target:
            print(f"rl_segment: {loop.progress_line(row, user.iterations)}", flush=True)

    remaining = target - (origin.iteration if origin else 0)
    with retry_on_lost_workers("rl_segment"):
        result = loop.run_segment(cfg, local, remaining, on_iteration)
    if remote is not None:  # mirror every checkpoint this segment wrote, oldest first (parents before children)
        for path in _chain_until(result.checkpoint, local):
            published.append(storage.publish(path, cfg, remote, aliases).uri)
        final = storage.describe(published[-1]) if published else origin
    else:
        final = storage.describe(result.checkpoint)
    decks.served = [s.model_dump() for s in read_manifest(result.checkpoint).served]
    decks.set_lineage(final.uri)
    decks.publish()
    rows = [r for r in decks.rows if r.get("iteration", 0) > start_iteration]
    checkpoint = tag(CheckpointArtifact, final, user.experiment, final.step)
    return SegmentOut(checkpoint=checkpoint, metrics=metrics_dataset(rows))


def _history(origin: Checkpoint | None) -> list[dict[str, float]]:
    return checkpoint_metrics_history(origin.uri) if origin is not None else []


def _chain_until(newest: str, stop: str | None) -> list[str]:
    """Local checkpoint dirs from just after `stop` up to `newest`, oldest first (the manifests' parent chain)."""
    import os

    def is_stop(loc: str) -> bool:
        return storage.is_uri(loc) or (stop is not None and os.path.realpath(loc) == os.path.realpath(stop))

    if is_stop(newest):
        return []
    return [entry.location for entry in reversed(lineage_chain(newest, until=is_stop).entries)]
