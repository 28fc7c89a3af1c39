"""RayCluster/RayJob manifests against the openAPIV3Schema of the KubeRay v1.7.0 CRDs in ../shared/kuberay-crds.

Two passes per object: the API server's view (defaults applied, unknown fields allowed, then pruned) and a
strict one (unknown fields rejected, like `kubectl apply` with Strict field validation). When ../shared is not
beside the repo the CRD tests are skipped with that reason, never passed.
"""

from __future__ import annotations

import copy

import pytest
from crd_validate import apply_defaults, list_type_errors, strict_schema, validate_custom_resource
from k8s_objects import RAY_KINDS, cluster_spec, one

OVERLAYS = ["base", "overlays/cpu-dev", "overlays/gpu"]


@pytest.mark.parametrize("strict", [False, True], ids=["server", "strict"])
@pytest.mark.parametrize("where", OVERLAYS)
def test_ray_objects_match_crd_schema(rendered, crd_files, where, strict):
    ray_objects = [o for o in rendered[where] if o["kind"] in RAY_KINDS]
    assert sorted(o["kind"] for o in ray_objects) == ["RayCluster", "RayJob"]  # nothing silently unvalidated
    for obj in ray_objects:
        errors = validate_custom_resource(obj, crd_files[obj["kind"]], strict=strict)
        assert errors == [], f"{where} {obj['kind']}/{obj['metadata']['name']}: {errors}"


def test_every_ray_object_in_k8s_is_validated(rendered):
    """Ray objects exist only in the kustomizations this file validates."""
    for where, objects in rendered.items():
        if where not in OVERLAYS:
            assert not [o for o in objects if o["kind"] in RAY_KINDS], where


def _gpu_rayjob(rendered) -> dict:
    return copy.deepcopy(one(rendered["overlays/gpu"], "RayJob"))


def _worker(obj: dict) -> dict:
    return cluster_spec(obj)["workerGroupSpecs"][0]


def test_strict_pass_rejects_a_typo_the_server_would_prune(rendered, crd_files):
    job = _gpu_rayjob(rendered)
    _worker(job)["template"]["spec"]["containers"][0]["resource"] = {"limits": {"cpu": "1"}}
    assert validate_custom_resource(job, crd_files["RayJob"], strict=False) == []
    errors = validate_custom_resource(job, crd_files["RayJob"], strict=True)
    assert len(errors) == 1 and "'resource' was unexpected" in errors[0]


def test_required_fields_with_defaults_pass_only_once_defaults_are_applied(rendered, crd_files):
    job = _gpu_rayjob(rendered)
    del _worker(job)["minReplicas"], _worker(job)["maxReplicas"]
    assert validate_custom_resource(job, crd_files["RayJob"], strict=True) == []
    errors = validate_custom_resource(job, crd_files["RayJob"], strict=True, defaults=False)
    assert sorted(e.split(": ", 1)[1] for e in errors) == [
        "'maxReplicas' is a required property",
        "'minReplicas' is a required property",
    ]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda j: _worker(j)["template"]["spec"]["containers"][0]["resources"]["limits"].update(cpu="eight"), "match"),
        (lambda j: cluster_spec(j)["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "not of type 'string'"),
        (lambda j: cluster_spec(j).update(authOptions={"mode": "password"}), "is not one of"),
        (lambda j: j["spec"].update(ttlSecondsAfterFinished="600"), "not of type 'integer'"),
        (lambda j: _worker(j).pop("groupName"), "'groupName' is a required property"),
        (
            lambda j: cluster_spec(j)["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
                {"name": "HOME", "value": "/root"}
            ),
            "duplicate entry",
        ),
    ],
    ids=["quantity", "start-param-type", "enum", "int-type", "required", "list-map-duplicate"],
)
def test_invalid_rayjobs_are_rejected(rendered, crd_files, mutate, needle):
    job = _gpu_rayjob(rendered)
    mutate(job)
    errors = validate_custom_resource(job, crd_files["RayJob"], strict=True)
    assert errors and any(needle in e for e in errors), errors


def test_kind_mismatch_is_an_error(rendered, crd_files):
    cluster = one(rendered["overlays/gpu"], "RayCluster")
    assert "the CRD defines ray.io/RayJob" in validate_custom_resource(cluster, crd_files["RayJob"], strict=True)[0]


# --- the validator's pieces on small schemas (no CRD needed) ----------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "default": "auto"},
                "opts": {"type": "object", "properties": {"n": {"type": "integer", "default": 1}}},
                "items": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name", "proto"],
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "proto": {"type": "string", "default": "TCP"},
                            "when": {"type": "string", "nullable": True},
                        },
                    },
                },
                "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
                "free": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "metadata": {"type": "object"},
    },
}


def test_apply_defaults_fills_missing_only_inside_existing_parents():
    out = apply_defaults(SCHEMA, {"spec": {"items": [{"name": "a"}, {"name": "b", "proto": "UDP"}]}})
    assert out == {"spec": {"mode": "auto", "items": [{"name": "a", "proto": "TCP"}, {"name": "b", "proto": "UDP"}]}}
    assert apply_defaults(SCHEMA, {"spec": {"opts": {}}})["spec"]["opts"] == {"n": 1}
    assert apply_defaults(SCHEMA, {}) == {}  # no spec -> no defaults invented under it


def test_strict_schema_closes_objects_but_keeps_maps_and_free_metadata():
    import jsonschema

    closed = jsonschema.Draft4Validator(strict_schema(SCHEMA))
    assert closed.is_valid({"metadata": {"anything": 1}, "spec": {"free": {"k": "v"}}})
    assert not closed.is_valid({"spec": {"mode": "x", "typo": 1}})
    assert not closed.is_valid({"spec": {"items": [{"name": "a", "extra": 1}]}})
    assert closed.is_valid({"spec": {"items": [{"name": "a", "when": None}]}})  # nullable
    assert "additionalProperties" not in SCHEMA["properties"]["spec"]  # the input schema is not modified


def test_list_type_map_and_set_uniqueness():
    ok = {"spec": {"items": [{"name": "a"}, {"name": "a", "proto": "UDP"}], "tags": ["x", "y"]}}
    assert list_type_errors(SCHEMA, ok) == []
    dup_default = {"spec": {"items": [{"name": "a"}, {"name": "a", "proto": "TCP"}]}}
    assert len(list_type_errors(SCHEMA, dup_default)) == 1  # a missing key counts as its default
    assert len(list_type_errors(SCHEMA, {"spec": {"tags": ["x", "x"]}})) == 1


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_gpu_rollout_group_is_validated_beside_the_trainers(rendered, crd_files, kind):
    """The gpu overlay's second worker group (the rollout engines) goes through the same schema: a mistake in it is
    found, not only in the trainer group."""
    obj = copy.deepcopy(one(rendered["overlays/gpu"], kind))
    groups = cluster_spec(obj)["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["gpu-workers", "rollout-workers"]
    assert validate_custom_resource(obj, crd_files[kind], strict=True) == []
    groups[1]["rayStartParams"]["resources"] = {"rollout_engine": 1}  # must be the string `ray start` gets
    errors = validate_custom_resource(obj, crd_files[kind], strict=True)
    assert len(errors) == 1 and "workerGroupSpecs/1/rayStartParams/resources" in errors[0], errors
