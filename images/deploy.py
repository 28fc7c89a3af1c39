"""Deployment constants: the one place that names the Ray version, the images and the Ray pod shapes.

Three consumers must agree on them: the kustomize manifests under ``k8s/`` (checked by
``tests/k8s/test_k8s_consistency.py``), the Flyte tasks' ``RayJobConfig`` (``tasks/ray_config.py`` builds it from
:func:`profile`), and the images built under ``images/``. Changing a value here without changing the manifests fails
the consistency test, so a cluster never runs a Ray version or pod shape the code was not written for.

Images default to the registry of the Flyte demo cluster (``localhost:30000``, what ``flytectl demo start``
exposes). Another registry is a kustomize ``images:`` entry in your own overlay (``newName``/``newTag``) plus the
same name passed to ImageSpec; nothing else hard-codes it.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlpipe.errors import ConfigError

RAY_VERSION = "2.60.0"
"""Ray version of the images and of ``spec.rayVersion`` in every RayCluster/RayJob (pinned in pyproject.toml)."""

IMAGE_REGISTRY = "localhost:30000"
IMAGE_TAG = "0.1.0"
CPU_IMAGE = f"{IMAGE_REGISTRY}/rlpipe-cpu:{IMAGE_TAG}"
"""CPU image (torch CPU wheel + rlpipe); the kustomize base and the cpu-dev overlay use it."""
GPU_IMAGE = f"{IMAGE_REGISTRY}/rlpipe-gpu:{IMAGE_TAG}"
"""CUDA image; the gpu overlay swaps CPU_IMAGE for it with a kustomize ``images:`` entry."""

SERVICE_ACCOUNT = "rlpipe-ray"
"""Service account of the Ray head, worker and submitter pods (no RBAC bound: Ray pods never call the k8s API)."""

GPU_RESOURCE = "nvidia.com/gpu"
"""Extended resource name the NVIDIA device plugin advertises."""


class RayGroupShape(BaseModel):
    """Resources of every pod of one Ray node group (requests == limits, so pods are Guaranteed QoS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu: str = Field(description="CPU request and limit per pod, a Kubernetes quantity ('2', '500m').")
    memory: str = Field(description="Memory request and limit per pod, a Kubernetes quantity; includes /dev/shm.")
    gpu: int = Field(0, ge=0, description="nvidia.com/gpu per pod (0 = CPU-only group).")
    replicas: int = Field(1, ge=0, description="Pods in the group (the head group always has one).")
    shm: str = Field(
        description="sizeLimit of the memory-backed emptyDir at /dev/shm: holds Ray's object store (default 30% of "
        "memory, so keep shm >= that) and NCCL's intra-node buffers; it counts against the memory limit."
    )

    ray_resources: dict[str, int] = Field(
        default_factory=dict,
        description="Custom Ray resources every pod of the group advertises (`ray start --resources`), so rlpipe's "
        "placement can pick the group: `train.resources` for the trainer ranks, the engines' resources for rollout.",
    )

    def ray_start_params(self) -> dict[str, str]:
        """The group's `rayStartParams` (KubeRay and Flyte's WorkerNodeConfig alike): its custom resources, if any.

        KubeRay pastes each value into a shell command line, so the JSON goes in double quotes with its own quotes
        escaped (the form of KubeRay's own examples: `'"{\\"Custom1\\": 1}"'`)."""
        if not self.ray_resources:
            return {}
        return {"resources": '"' + json.dumps(self.ray_resources, sort_keys=True).replace('"', '\\"') + '"'}

    def k8s_resources(self) -> dict[str, str]:
        """The container's `requests` (and identical `limits`) mapping as the manifests spell it."""
        out = {"cpu": self.cpu, "memory": self.memory}
        if self.gpu:
            out[GPU_RESOURCE] = str(self.gpu)
        return out


HEAD_RESOURCES = RayGroupShape(cpu="1", memory="4Gi", gpu=0, replicas=1, shm="2Gi")
"""Ray head: GCS, dashboard and the `rlpipe run` driver; started with num-cpus=0 so no actor lands on it."""
CPU_WORKER = RayGroupShape(cpu="2", memory="4Gi", gpu=0, replicas=2, shm="2Gi")
"""CPU worker group: 2 pods x 2 CPUs hold the default train.world_size=2 TrainingWorkers (1 CPU each)."""
GPU_HEAD = RayGroupShape(cpu="4", memory="16Gi", gpu=0, replicas=1, shm="6Gi")
"""Ray head of the GPU profile: GCS, the dashboard and the `rlpipe run` driver, no GPU. The driver tokenizes, judges
and writes lineage; it holds no model weights: the engine replicas run on the rollout-workers group
(`rollout.vllm.replicas` in grpo-gpu.yaml) and each weight sync's object goes from trainer rank 0's node straight to
the engine nodes, never through the head. Its object store holds only the base model's files once, when the replicas
start (a larger model spills to disk). Started with num-cpus=0 and num-gpus=0: Ray schedules no actor there."""
TRAINER_RESOURCE = "trainer"
"""Custom Ray resource of the trainer pods; the gpu config's `train.resources` asks for it, so no TrainingWorker lands
on an engine pod."""
ROLLOUT_RESOURCE = "rollout_engine"
"""Custom Ray resource of the rollout-engine pods, one per pod: what a managed engine replica asks for."""
GPU_WORKER = RayGroupShape(cpu="8", memory="64Gi", gpu=1, replicas=2, shm="24Gi", ray_resources={TRAINER_RESOURCE: 1})
"""GPU trainer group: one TrainingWorker per GPU (num_gpus=1), NCCL between pods."""
GPU_ROLLOUT = RayGroupShape(cpu="8", memory="64Gi", gpu=1, replicas=2, shm="24Gi", ray_resources={ROLLOUT_RESOURCE: 1})
"""GPU rollout group: one engine replica per pod (its GPU and `rollout_engine: 1`), beside the trainer group."""


class DeployProfile(BaseModel):
    """Everything that differs between the cpu-dev and the gpu deployment of the same Ray job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["cpu", "gpu"] = Field(description="Profile name; the kustomize overlay is k8s/overlays/<overlay>.")
    overlay: str = Field(description="Directory name of the kustomize overlay under k8s/overlays/.")
    namespace: str = Field(description="Namespace the overlay deploys to (Flyte's '{{ project }}-{{ domain }}').")
    image: str = Field(description="Container image of head, workers and submitter.")
    ray_version: str = Field(RAY_VERSION, description="spec.rayVersion of the RayCluster/RayJob.")
    head: RayGroupShape = Field(description="Shape of the head pod.")
    worker: RayGroupShape = Field(description="Shape of each worker pod.")
    worker_group: str = Field(description="groupName of the trainer worker group.")
    rollout: RayGroupShape | None = Field(
        None, description="Shape of each rollout-engine pod; None: no rollout group (the engine is colocated)."
    )
    rollout_group: str | None = Field(None, description="groupName of the rollout worker group, with `rollout`.")

    @model_validator(mode="after")
    def _rollout_has_a_name(self) -> DeployProfile:
        if (self.rollout is None) != (self.rollout_group is None):
            raise ValueError(f"profile {self.kind}: set rollout and rollout_group together")
        return self

    def worker_groups(self) -> list[tuple[str, RayGroupShape]]:
        """(groupName, shape) of every worker group, in the manifests' order: trainers first, then rollout."""
        groups = [(self.worker_group, self.worker)]
        if self.rollout is not None and self.rollout_group is not None:  # both or neither (validated)
            groups.append((self.rollout_group, self.rollout))
        return groups


PROFILES: dict[str, DeployProfile] = {
    "cpu": DeployProfile(
        kind="cpu",
        overlay="cpu-dev",
        namespace="rlpipe-development",
        image=CPU_IMAGE,
        head=HEAD_RESOURCES,
        worker=CPU_WORKER,
        worker_group="cpu-workers",
    ),
    "gpu": DeployProfile(
        kind="gpu",
        overlay="gpu",
        namespace="rlpipe-production",
        image=GPU_IMAGE,
        head=GPU_HEAD,
        worker=GPU_WORKER,
        worker_group="gpu-workers",
        rollout=GPU_ROLLOUT,
        rollout_group="rollout-workers",
    ),
}


def profile(kind: str) -> DeployProfile:
    """The deployment profile `kind` ('cpu' or 'gpu'); unknown names are a ConfigError listing the valid ones."""
    try:
        return PROFILES[kind]
    except KeyError:
        raise ConfigError(f"unknown deployment kind {kind!r}; expected one of {sorted(PROFILES)}") from None
