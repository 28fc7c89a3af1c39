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

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
GPU_HEAD = RayGroupShape(cpu="8", memory="48Gi", gpu=1, replicas=1, shm="16Gi")
"""Ray head of the GPU profile: the `rlpipe run` driver and the vLLM rollout server it starts and owns
(`rollout.engine=vllm`, on the pod's GPU, reached at 127.0.0.1, so its admin routes never leave the pod). Started
with num-cpus=0 and num-gpus=0: Ray schedules no TrainingWorker there."""
GPU_WORKER = RayGroupShape(cpu="8", memory="64Gi", gpu=1, replicas=2, shm="24Gi")
"""GPU worker group: one TrainingWorker per GPU (num_gpus=1), NCCL between pods."""


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
    worker_group: str = Field(description="groupName of the single worker group.")


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
    ),
}


def profile(kind: str) -> DeployProfile:
    """The deployment profile `kind` ('cpu' or 'gpu'); unknown names are a ConfigError listing the valid ones."""
    try:
        return PROFILES[kind]
    except KeyError:
        raise ConfigError(f"unknown deployment kind {kind!r}; expected one of {sorted(PROFILES)}") from None
