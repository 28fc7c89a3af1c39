"""kustomize builds of k8s/ render, and the pure-Python renderer does what kustomize does for the features used."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest
import yaml
from k8s_objects import K8S, kustomization_dirs
from kustomize_render import KustomizeError, json6902, render, split_image, strategic_merge

from images.deploy import PROFILES


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _canonical(objects: list[dict]) -> list[str]:
    return sorted(json.dumps(o, sort_keys=True) for o in objects)


def test_every_kustomization_is_found_and_renders(rendered):
    names = set(rendered)
    assert {"base", "overlays/cpu-dev", "overlays/gpu", "flyte"} <= names
    for name, objects in rendered.items():
        assert objects, f"{name} rendered nothing"
        assert all(o.get("metadata", {}).get("name") for o in objects), name


@pytest.mark.parametrize("kind", sorted(PROFILES))
def test_overlay_namespace_and_labels(overlay, kind):
    prof = PROFILES[kind]
    objects = overlay(prof.overlay)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"] == [prof.namespace]
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] != "Namespace":
            assert meta["namespace"] == prof.namespace, (obj["kind"], meta["name"])
        assert meta["labels"]["app.kubernetes.io/part-of"] == "rlpipe"
        assert meta["labels"]["rlpipe.dev/profile"] == prof.overlay
    binding = next(o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "flyte-ray-plugin")
    assert binding["subjects"][0]["namespace"] == "flyte"  # a subject in another namespace is never rewritten


def test_base_has_no_namespace_so_overlay_patches_match_by_name(rendered):
    assert all("namespace" not in o["metadata"] for o in rendered["base"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not on PATH: no cross-check with kustomize")
@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda d: str(d.relative_to(K8S)))
def test_matches_kubectl_kustomize(directory):
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    assert _canonical(render(directory)) == _canonical(theirs)


# --- the renderer itself, on small kustomizations with hand-written expected output ----------------------------


def test_overlay_features_end_to_end(tmp_path):
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": """
                resources: [objs.yaml]
                configMapGenerator:
                  - name: cfg
                    files: [a.txt, renamed=b.txt]
                    literals: [k=v]
                    options: {disableNameSuffixHash: true}
            """,
            "base/a.txt": "A\n",
            "base/b.txt": "B\n",
            "base/objs.yaml": """
                apiVersion: v1
                kind: Namespace
                metadata: {name: placeholder}
                ---
                apiVersion: rbac.authorization.k8s.io/v1
                kind: RoleBinding
                metadata: {name: rb}
                roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: r}
                subjects:
                  - {kind: ServiceAccount, name: default}
                  - {kind: ServiceAccount, name: other, namespace: elsewhere}
                ---
                apiVersion: example.io/v1
                kind: Thing
                metadata: {name: t, labels: {keep: "yes"}}
                spec:
                  deep:
                    template:
                      spec:
                        initContainers: [{name: i, image: "reg:5000/app:1"}]
                        containers:
                          - {name: c, image: "reg:5000/app:1", env: [{name: A, value: "1"}]}
                          - {name: d, image: "other/app:1"}
                  modes: [a, b]
                  drop: me
            """,
            "over/kustomization.yaml": """
                namespace: ns1
                labels:
                  - pairs: {team: rl}
                    includeSelectors: false
                resources: [../base]
                images:
                  - {name: "reg:5000/app", newName: "reg:5000/app-gpu", newTag: "2"}
                patches:
                  - path: smp.yaml
                  - target: {group: example.io, kind: Thing, name: "t"}
                    patch: |
                      - {op: add, path: /spec/deep/template/spec/containers/0/env/-, value: {name: B, value: "2"}}
                      - {op: test, path: /spec/deep/template/spec/containers/1/name, value: d}
                      - {op: remove, path: /spec/deep/template/spec/containers/1}
            """,
            "over/smp.yaml": """
                apiVersion: example.io/v1
                kind: Thing
                metadata: {name: t}
                spec: {modes: [c], drop: null, added: {x: 1}}
            """,
        },
    )
    objects = {o["kind"]: o for o in render(tmp_path / "over")}
    assert objects["Namespace"]["metadata"] == {"name": "ns1", "labels": {"team": "rl"}}
    assert objects["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "default", "namespace": "ns1"},
        {"kind": "ServiceAccount", "name": "other", "namespace": "elsewhere"},
    ]
    thing = objects["Thing"]
    assert thing["metadata"] == {"name": "t", "namespace": "ns1", "labels": {"keep": "yes", "team": "rl"}}
    assert thing["spec"] == {
        "deep": {
            "template": {
                "spec": {
                    "initContainers": [{"name": "i", "image": "reg:5000/app-gpu:2"}],
                    "containers": [
                        {
                            "name": "c",
                            "image": "reg:5000/app-gpu:2",
                            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        }
                    ],
                }
            }
        },
        "modes": ["c"],
        "added": {"x": 1},
    }
    assert objects["ConfigMap"]["data"] == {"a.txt": "A\n", "renamed": "B\n", "k": "v"}
    assert objects["ConfigMap"]["metadata"]["namespace"] == "ns1"


def test_configmap_generator_behaviors(tmp_path):
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": """
                configMapGenerator:
                  - {name: cfg, literals: [a=1, b=2], options: {disableNameSuffixHash: true}}
            """,
            "merge/kustomization.yaml": """
                resources: [../base]
                configMapGenerator:
                  - {name: cfg, behavior: merge, literals: [b=3], options: {disableNameSuffixHash: true}}
            """,
            "replace/kustomization.yaml": """
                resources: [../base]
                configMapGenerator:
                  - {name: cfg, behavior: replace, literals: [c=4], options: {disableNameSuffixHash: true}}
            """,
            "dup/kustomization.yaml": """
                resources: [../base]
                configMapGenerator:
                  - {name: cfg, literals: [c=4], options: {disableNameSuffixHash: true}}
            """,
            "hash/kustomization.yaml": """
                configMapGenerator:
                  - {name: cfg, literals: [c=4]}
            """,
        },
    )
    assert render(tmp_path / "merge")[0]["data"] == {"a": "1", "b": "3"}
    assert render(tmp_path / "replace")[0]["data"] == {"c": "4"}
    with pytest.raises(KustomizeError, match="already exists"):
        render(tmp_path / "dup")
    with pytest.raises(KustomizeError, match="disableNameSuffixHash"):
        render(tmp_path / "hash")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"kustomization.yaml": "commonLabels: {a: b}\n"}, "not supported"),
        ({"kustomization.yaml": "resources: [missing.yaml]\n"}, "not found"),
        ({"kustomization.yaml": "labels: [{pairs: {a: b}, includeSelectors: true}]\n"}, "includeSelectors"),
        (
            {
                "kustomization.yaml": "resources: [o.yaml]\npatches: [{path: p.yaml}]\n",
                "o.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n",
                "p.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\ndata: {x: y}\n",
            },
            "matches no object",
        ),
        (
            {
                "kustomization.yaml": "resources: [o.yaml]\npatches: [{path: p.yaml}]\n",
                "o.yaml": "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n",
                "p.yaml": "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c, image: i}]}\n",
            },
            "merge keys",
        ),
        (
            {
                "kustomization.yaml": "resources: [o.yaml, o2.yaml]\n",
                "o.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n",
                "o2.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n",
            },
            "duplicate object",
        ),
        (
            {
                "kustomization.yaml": "resources: [o.yaml]\npatches: [{path: p.yaml}]\n",
                "o.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n",
                "p.yaml": "- {op: add, path: /data, value: {}}\n",
            },
            "needs a target",
        ),
    ],
)
def test_unsupported_or_inconsistent_kustomizations_fail_loudly(tmp_path, files, message):
    _write(tmp_path, files)
    with pytest.raises(KustomizeError, match=message):
        render(tmp_path)


def test_json6902_operations():
    doc = {"a": {"b": [1, 2], "c/d": {"~e": 0}}}
    json6902(
        doc,
        [
            {"op": "add", "path": "/a/b/1", "value": 9},
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "replace", "path": "/a/c~1d/~0e", "value": 5},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "add", "path": "/a/new", "value": {"x": [1]}},
            {"op": "test", "path": "/a/new/x/0", "value": 1},
            {"op": "copy", "from": "/a/new", "path": "/a/b/-"},
            {"op": "replace", "path": "/a/b/3/x/0", "value": 7},  # a copy, not the same object
        ],
    )
    assert doc == {"a": {"b": [9, 2, 3, {"x": [7]}], "c/d": {"~e": 5}, "new": {"x": [1]}}}
    for bad in (
        {"op": "replace", "path": "/a/missing", "value": 1},
        {"op": "remove", "path": "/a/b/7"},
        {"op": "test", "path": "/a/b/0", "value": 0},
        {"op": "move", "from": "/a/b", "path": "/a/z"},
        {"op": "copy", "path": "/a/z"},
        {"op": "copy", "from": "/a/nothing", "path": "/a/z"},
        {"op": "add", "path": "/a/b/0/deeper", "value": 1},
    ):
        with pytest.raises(KustomizeError):
            json6902(doc, [bad])


def test_strategic_merge_subset():
    base = {"spec": {"keep": 1, "drop": 2, "nested": {"a": 1}, "modes": ["x", "y"]}}
    patch = {"spec": {"drop": None, "nested": {"b": 2}, "modes": ["z"]}}
    assert strategic_merge(base, patch) == {"spec": {"keep": 1, "nested": {"a": 1, "b": 2}, "modes": ["z"]}}
    assert base["spec"]["drop"] == 2  # the input is not modified
    with pytest.raises(KustomizeError, match=r"\$patch"):
        strategic_merge(base, {"spec": {"$patch": "replace"}})


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("localhost:30000/rlpipe-cpu:0.1.0", ("localhost:30000/rlpipe-cpu", "0.1.0", None)),
        ("localhost:30000/rlpipe-cpu", ("localhost:30000/rlpipe-cpu", None, None)),
        ("busybox", ("busybox", None, None)),
        ("ghcr.io/a/b:1@sha256:abc", ("ghcr.io/a/b", "1", "sha256:abc")),
        ("ghcr.io/a/b@sha256:abc", ("ghcr.io/a/b", None, "sha256:abc")),
    ],
)
def test_split_image(image, expected):
    assert split_image(image) == expected
