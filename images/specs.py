"""ImageSpecs of the CPU and the CUDA image, named exactly as `images.deploy.CPU_IMAGE` / `GPU_IMAGE`.

Why fixed names (`tag_format` without the spec hash): the kustomize manifests under `k8s/` and the Flyte tasks must
run the same image, and `images.deploy` is the one place that names it. Bump `images.deploy.IMAGE_TAG` when the
packages change (or set FLYTE_FORCE_PUSH_IMAGE_SPEC=true to rebuild the same tag).

Importing or serializing needs no Docker: an ImageSpec is a description; flytekit only builds it when a registration
resolves it, and when it cannot reach Docker or the registry it assumes the image exists (unless FLYTE_IMG_FAST_FAIL
is set). So `pyflyte package` and `pyflyte register --dry-run --copy none` work offline. Build explicitly with
`pyflyte build workflows/grpo.py grpo` or `docker` on a machine that has it.

flytekit's default builder creates and switches to the non-root user `flytekit`; the images run as that user.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

from images.deploy import CPU_IMAGE, GPU_IMAGE, IMAGE_REGISTRY, IMAGE_TAG

PYTHON_VERSION = "3.11"
"""Python of both images (pyproject: requires-python >=3.11,<3.13)."""

PINNED_PACKAGES = [
    "torch==2.13.0",
    "ray[default]==2.60.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "accelerate==1.15.0",
    "peft==0.21.2",
    "pandas==3.1.1",
    "pyarrow==26.0.1",
    "pydantic==2.14.4",
    "pyyaml==6.0.4",
    "tqdm==4.70.1",
    "numpy==2.4.6",
    "gguf==0.19.0",
    "flytekit==1.16.31",
    "flytekitplugins-ray==1.16.31",
    "flytekitplugins-deck-standard==1.16.31",
    "kubernetes==37.0.1",
    "python-dateutil==2.9.0.post0",
    "matplotlib==3.11.2",
]
"""The runtime pins of pyproject.toml `[project].dependencies`, verbatim (a test keeps them equal). Written out
rather than read from pyproject.toml because task containers import this module where no pyproject.toml exists,
and the spec (hence its id) must be identical at registration and at run time."""

CPU_BASE_IMAGE = "python:3.11-slim-bookworm"
"""Debian slim with CPython; torch comes from the CPU wheel index."""
CUDA_BASE_IMAGE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
"""CUDA 12.8 runtime + cuDNN (no compiler needed: no custom kernels); Python is installed by the builder."""
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu128"

ENV = {
    "RAY_AUTH_MODE": "disabled",  # cluster Ray is reached inside the pod network; KubeRay sets up the address
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",  # models come from checkpoints/model dirs, never from the Hub at run time
    "PYTHONUNBUFFERED": "1",
}


VLLM_VERSION = "0.32.0"
"""vLLM of the GPU image's rollout server (rollout.engine=vllm); the CPU build for local runs is scripts/setup_vllm.sh."""
VLLM_PYTHON = "/opt/vllm/bin/python"
"""Its own venv: vLLM pins its torch and `transformers<5.20`, which rlpipe's pins do not allow in one environment."""
VLLM_VENV_COMMANDS = [
    "python -m venv /opt/vllm",
    f"/opt/vllm/bin/pip install --no-cache-dir vllm=={VLLM_VERSION}",
]
"""Build steps of the GPU image: the separate vLLM venv the driver starts the server from (RLPIPE_VLLM_PYTHON)."""


def _registry() -> str:
    """The image registry: RLPIPE_IMAGE_REGISTRY, else `images.deploy.IMAGE_REGISTRY` (the demo cluster's)."""
    return os.environ.get("RLPIPE_IMAGE_REGISTRY", IMAGE_REGISTRY)


def image_spec(kind: str) -> ImageSpec:
    """The ImageSpec of the `kind` ('cpu' or 'gpu') image; unknown kinds are a ValueError."""
    common = dict(
        python_version=PYTHON_VERSION,
        registry=_registry(),
        packages=list(PINNED_PACKAGES),
        apt_packages=["git", "ca-certificates"],
        env=dict(ENV),
        tag_format=IMAGE_TAG,
        platform="linux/amd64",
    )
    if kind == "cpu":
        return ImageSpec(name="rlpipe-cpu", base_image=CPU_BASE_IMAGE, pip_extra_index_url=[CPU_TORCH_INDEX], **common)
    if kind == "gpu":
        common["env"]["RLPIPE_VLLM_PYTHON"] = VLLM_PYTHON
        return ImageSpec(
            name="rlpipe-gpu",
            base_image=CUDA_BASE_IMAGE,
            pip_extra_index_url=[CUDA_TORCH_INDEX],
            commands=list(VLLM_VENV_COMMANDS),
            **common,
        )
    raise ValueError(f"unknown image kind {kind!r}; expected 'cpu' or 'gpu'")


CPU_IMAGE_SPEC = image_spec("cpu")
GPU_IMAGE_SPEC = image_spec("gpu")

if os.environ.get("RLPIPE_IMAGE_REGISTRY") is None:
    # With the default registry the names are exactly the deployment constants the k8s manifests use.
    _names = (CPU_IMAGE_SPEC.image_name(), GPU_IMAGE_SPEC.image_name())
    if _names != (CPU_IMAGE, GPU_IMAGE):
        raise RuntimeError(f"ImageSpec names {_names} differ from images.deploy {(CPU_IMAGE, GPU_IMAGE)}")
