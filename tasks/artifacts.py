"""Flyte Artifacts the tasks emit, partitioned by experiment and step.

On a Union backend these make checkpoints, rollout batches and exported models queryable
(`CheckpointArtifact.query(experiment="grpo-sum")`) and draw lineage between runs. On open-source Flyte and in local
runs the partition values are only metadata on the output literal: nothing fails and nothing depends on them (resume
uses the checkpoint root, lineage is in every checkpoint's manifest.json).
"""

from __future__ import annotations

from typing import TypeVar

from flytekit import Artifact

PARTITION_KEYS = ["experiment", "step"]

CheckpointArtifact = Artifact(name="rlpipe_checkpoint", partition_keys=PARTITION_KEYS)
RolloutBatchArtifact = Artifact(name="rlpipe_rollout_batch", partition_keys=PARTITION_KEYS)
HFModelArtifact = Artifact(name="rlpipe_hf_model", partition_keys=PARTITION_KEYS)
MetricsArtifact = Artifact(name="rlpipe_metrics", partition_keys=PARTITION_KEYS)

T = TypeVar("T")


def tag(artifact: Artifact, value: T, experiment: str, step: int) -> T:
    """Attach the runtime partition values to an output value (no-op outside a task execution)."""
    return artifact.create_from(value, experiment=experiment, step=str(step))
