"""Paths and small accessors shared by the k8s tests (where the manifests and CRDs are, pods of Ray objects)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# ../shared beside the repo (CI clones the repo elsewhere with shared/ next to it).
SHARED = REPO / ".." / "shared"
CRD_DIR = SHARED / "kuberay-crds"
CRD_FILES = {"RayCluster": CRD_DIR / "ray.io_rayclusters.yaml", "RayJob": CRD_DIR / "ray.io_rayjobs.yaml"}
CRD_MISSING = "../shared/kuberay-crds not found: CRD validation skipped"

RAY_KINDS = ("RayCluster", "RayJob")


def kustomization_dirs() -> list[Path]:
    """Every directory under k8s/ that holds a kustomization."""
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    """The single object of `kind` (and `name`); fails the test if there is none or more than one."""
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def cluster_spec(obj: dict) -> dict:
    """The RayCluster spec of a RayCluster or of a RayJob."""
    return obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]


def pod_templates(obj: dict) -> Iterator[tuple[str, dict, int]]:
    """(role, pod template, max pod count) of every pod a Ray object creates: head, each worker group, submitter."""
    spec = cluster_spec(obj)
    yield "head", spec["headGroupSpec"]["template"], 1
    for group in spec.get("workerGroupSpecs", []):
        count = max(group.get("replicas", 0), group.get("maxReplicas", 0) if obj["kind"] == "RayCluster" else 0)
        yield f"worker:{group['groupName']}", group["template"], count
    if obj["kind"] == "RayJob" and "submitterPodTemplate" in obj["spec"]:
        yield "submitter", obj["spec"]["submitterPodTemplate"], 1


def all_pod_templates(objects: list[dict]) -> Iterator[tuple[str, dict, int]]:
    """pod_templates of every Ray object in `objects`, roles prefixed with kind/name."""
    for obj in objects:
        if obj["kind"] in RAY_KINDS:
            for role, template, count in pod_templates(obj):
                yield f"{obj['kind']}/{obj['metadata']['name']}/{role}", template, count


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity ('500m', '4Gi', '2', 1e3) as a Decimal in base units."""
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([KMGTPE]i|[numkMGTPE]?)", str(value).strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2)])
