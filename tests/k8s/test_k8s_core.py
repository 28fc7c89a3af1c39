"""Core Kubernetes objects (and the pod templates inside Ray objects) against the upstream schemas, strictly.

kubernetes-validate ships the OpenAPI schemas of each Kubernetes release; we validate against the newest one it
knows, in strict mode (unknown fields are errors). Pod templates of RayCluster/RayJob are also checked as a core
PodTemplate, which catches PodSpec mistakes against a newer Kubernetes than the one embedded in the CRD.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from k8s_objects import K8S, RAY_KINDS, all_pod_templates, kustomization_dirs
from kustomize_render import render

K8S_VERSION = kubernetes_validate.latest_version()


def _core_objects() -> list[tuple[str, dict]]:
    out = []
    for directory in kustomization_dirs():
        where = str(directory.relative_to(K8S))
        for obj in render(directory):
            if obj["kind"] not in RAY_KINDS:
                out.append((f"{where}:{obj['kind']}/{obj['metadata']['name']}", obj))
    return out


def _pod_templates() -> list[tuple[str, dict]]:
    out = []
    for directory in kustomization_dirs():
        where = str(directory.relative_to(K8S))
        for role, template, _ in all_pod_templates(render(directory)):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
            out.append((f"{where}:{role}", wrapped))
    return out


CORE = _core_objects()
PODS = _pod_templates()


def test_version_is_the_newest_supported():
    assert tuple(int(p) for p in K8S_VERSION.split(".")[:2]) >= (1, 37)


@pytest.mark.parametrize(("ident", "obj"), CORE, ids=[i for i, _ in CORE])
def test_core_object_is_valid(ident, obj):
    assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(("ident", "obj"), PODS, ids=[i for i, _ in PODS])
def test_ray_pod_template_is_a_valid_pod_template(ident, obj):
    assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_kind_is_covered():
    kinds = {obj["kind"] for _, obj in CORE}
    expected = {"Namespace", "ResourceQuota", "LimitRange", "ServiceAccount", "Role", "RoleBinding"}
    assert expected | {"PersistentVolumeClaim", "ConfigMap"} <= kinds
    assert len(PODS) >= 3 * 5  # 3 kustomizations x (RayCluster head+worker, RayJob head+worker+submitter)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"]["limits"][0].update(maximum={"cpu": "1"}),
        lambda o: o["spec"]["limits"][0].update(type=3),
        lambda o: o["spec"].update(limits={"type": "Container"}),
    ],
    ids=["unknown-field", "wrong-type", "object-for-list"],
)
def test_strict_validation_catches_mistakes(mutate):
    limitrange = copy.deepcopy(next(obj for _, obj in CORE if obj["kind"] == "LimitRange"))
    mutate(limitrange)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(limitrange, K8S_VERSION, strict=True)
