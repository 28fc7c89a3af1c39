"""Fixtures of the k8s tests: every kustomization rendered once per session, and the KubeRay CRD paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from k8s_objects import CRD_DIR, CRD_FILES, CRD_MISSING, K8S, kustomization_dirs
from kustomize_render import render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """{path of the kustomization relative to k8s/ ('base', 'overlays/gpu', ...): rendered objects}."""
    return {str(d.relative_to(K8S)): render(d) for d in kustomization_dirs()}


@pytest.fixture(scope="session")
def overlay(rendered):
    """overlay('gpu') -> the rendered objects of k8s/overlays/gpu."""
    return lambda name: rendered[f"overlays/{name}"]


@pytest.fixture(scope="session")
def crd_files() -> dict[str, Path]:
    """{kind: CRD file}; skips (visibly, with a reason) when ../shared/kuberay-crds is not beside the repo."""
    if not CRD_DIR.is_dir() or not all(p.is_file() for p in CRD_FILES.values()):
        pytest.skip(CRD_MISSING)
    return CRD_FILES
