"""Container images of the Flyte tasks (flytekit ImageSpec): a CPU image and a CUDA image."""

from images.specs import CPU_IMAGE_SPEC, GPU_IMAGE_SPEC, PINNED_PACKAGES, image_spec

__all__ = ["CPU_IMAGE_SPEC", "GPU_IMAGE_SPEC", "PINNED_PACKAGES", "image_spec"]
