"""Launch plans: a nightly retraining schedule and the default plan for the built-in task.

`grpo_nightly` runs at 02:00 UTC, resumes from the newest complete checkpoint of its experiment under the checkpoint
root (a listing of a path or bucket: works on open-source Flyte, no Artifact query needed) and trains
`NIGHTLY_ITERATIONS` more iterations. A night whose previous run is still going is skipped, not queued
(ConcurrencyPolicy max 1, SKIP), so two runs never write the same experiment's checkpoints.
Activate it after registering: `flytectl update launchplan -p <project> -d <domain> grpo_nightly --activate`.
"""

from __future__ import annotations

import os

from flytekit import CronSchedule, LaunchPlan
from flytekit.models.concurrency import ConcurrencyLimitBehavior, ConcurrencyPolicy

from workflows.grpo import grpo

NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_ITERATIONS = 10
NIGHTLY_EXPERIMENT = "grpo-sum-nightly"
NIGHTLY_CHECKPOINT_ROOT = os.environ.get("RLPIPE_CHECKPOINT_ROOT", "/data/runs/checkpoints")
"""Checkpoint root of the nightly run: the shared volume of k8s/base (ReadWriteMany PVC at /data) by default, or an
object-store URI (s3://bucket/prefix); set RLPIPE_CHECKPOINT_ROOT when registering to change it."""

NIGHTLY_OVERRIDES = [
    f"experiment={NIGHTLY_EXPERIMENT}",
    f"checkpoint.root={NIGHTLY_CHECKPOINT_ROOT}",
]

grpo_default = LaunchPlan.get_or_create(
    workflow=grpo,
    name="grpo_default",
    default_inputs={"overrides": []},
)
"""The built-in task with the tiny default model (same as `pyflyte run workflows/grpo.py grpo`)."""

grpo_nightly = LaunchPlan.get_or_create(
    workflow=grpo,
    name="grpo_nightly",
    schedule=CronSchedule(schedule=NIGHTLY_CRON),
    fixed_inputs={"resume": True},
    default_inputs={"overrides": NIGHTLY_OVERRIDES, "more_iterations": NIGHTLY_ITERATIONS},
    concurrency=ConcurrencyPolicy(max_concurrency=1, behavior=ConcurrencyLimitBehavior.SKIP),
)
