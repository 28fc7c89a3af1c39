"""A small pure-Python kustomize renderer: exactly the features the kustomizations under ``k8s/`` use.

Why: the tests must prove the overlays render without kubectl on the machine. Anything outside the subset is an
error (``KustomizeError``), never silently ignored, so a new kustomize feature in ``k8s/`` fails the tests until
the renderer learns it (or the test cross-checks with ``kubectl kustomize``, which it does when kubectl is present).

Supported kustomization fields and their semantics (kustomize v5):
- ``resources``: YAML files (multi-document) and directories holding a kustomization (rendered recursively).
- ``configMapGenerator``: ``files`` (``key=path`` or ``path``), ``literals``, ``behavior`` create/replace/merge;
  ``options.disableNameSuffixHash: true`` is required (no hash suffix, so no name-reference rewriting).
- ``patches``: a list of JSON6902 operations (add, remove, replace, test, copy) with a ``target``, or a strategic-merge
  patch whose target is the patch's own kind/name. Strategic merge here deep-merges mappings, deletes keys set to
  null and replaces lists of scalars; a list of mappings (whose merge depends on per-field merge keys) is refused.
- ``namespace``: sets metadata.namespace of namespaced objects, renames Namespace objects, and sets the namespace
  of RoleBinding subjects named "default" (kustomize's ``setRoleBindingSubjects: defaultOnly``).
- ``labels`` with ``includeSelectors: false`` (and no ``includeTemplates``): adds to metadata.labels.
- ``images``: rewrites ``image`` of every entry of any ``containers``/``initContainers`` list, at any depth (as
  kustomize does, which is what makes it work on CRDs), matching on the name without tag or digest.
Transformers run in the order patches, namespace, labels, images; none of our patches touches a field another
transformer writes, so the order is not observable in k8s/.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches", "configMapGenerator"}
_CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
}
_KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class KustomizeError(Exception):
    """A kustomization uses something this renderer does not implement, or is inconsistent."""


def load_yaml_documents(path: Path) -> list[dict]:
    """All non-empty YAML documents of a file, each required to be a Kubernetes object (a mapping with a kind)."""
    docs = [d for d in yaml.load_all(path.read_text(), Loader=_LOADER) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise KustomizeError(f"{path}: every document must be a Kubernetes object with apiVersion and kind")
    return docs


def find_kustomization(directory: Path) -> Path:
    """The kustomization file of `directory`."""
    for name in _KUSTOMIZATION_NAMES:
        if (directory / name).is_file():
            return directory / name
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def render(directory: str | Path) -> list[dict]:
    """Render the kustomization in `directory` into a list of Kubernetes objects (fresh copies)."""
    directory = Path(directory).resolve()
    kfile = find_kustomization(directory)
    spec = yaml.load(kfile.read_text(), Loader=_LOADER) or {}
    unknown = set(spec) - _KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{kfile}: fields not supported by this renderer: {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{kfile}: kind must be Kustomization")

    objects: list[dict] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(render(target))
        elif target.is_file():
            objects.extend(load_yaml_documents(target))
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} not found")
    _check_unique(objects, kfile)

    for gen in spec.get("configMapGenerator", []):
        _generate_configmap(objects, gen, directory, kfile)
    for patch in spec.get("patches", []):
        _apply_patch_entry(objects, patch, directory, kfile)
    if spec.get("namespace"):
        for obj in objects:
            _set_namespace(obj, spec["namespace"])
    for entry in spec.get("labels", []):
        _add_labels(objects, entry, kfile)
    for image in spec.get("images", []):
        _set_image(objects, image, kfile)
    _check_unique(objects, kfile)
    return objects


def _ident(obj: dict) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta.get("name", "")


def _check_unique(objects: list[dict], kfile: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        ident = _ident(obj)
        if ident in seen:
            raise KustomizeError(f"{kfile}: duplicate object {ident}")
        seen.add(ident)


# --- configMapGenerator -------------------------------------------------------------------------------------------


def _generate_configmap(objects: list[dict], gen: dict, directory: Path, kfile: Path) -> None:
    unknown = set(gen) - {"name", "files", "literals", "behavior", "options"}
    if unknown:
        raise KustomizeError(f"{kfile}: configMapGenerator fields not supported: {sorted(unknown)}")
    options = gen.get("options") or {}
    if set(options) - {"disableNameSuffixHash"} or options.get("disableNameSuffixHash") is not True:
        raise KustomizeError(f"{kfile}: configMapGenerator {gen['name']!r} needs options.disableNameSuffixHash: true")
    data: dict[str, str] = {}
    for item in gen.get("files", []):
        key, _, rel = item.partition("=") if "=" in item else (Path(item).name, "", item)
        data[key] = (directory / rel).read_text()
    for literal in gen.get("literals", []):
        key, sep, value = literal.partition("=")
        if not sep:
            raise KustomizeError(f"{kfile}: literal {literal!r} must be key=value")
        data[key] = value
    existing = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == gen["name"]]
    behavior = gen.get("behavior", "create")
    if behavior == "create":
        if existing:
            raise KustomizeError(f"{kfile}: ConfigMap {gen['name']!r} already exists (use behavior: replace/merge)")
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
        return
    if behavior not in ("replace", "merge"):
        raise KustomizeError(f"{kfile}: unknown configMapGenerator behavior {behavior!r}")
    if len(existing) != 1:
        raise KustomizeError(f"{kfile}: behavior {behavior} needs exactly one ConfigMap {gen['name']!r} to act on")
    target = existing[0]
    target["data"] = data if behavior == "replace" else {**target.get("data", {}), **data}


# --- patches ------------------------------------------------------------------------------------------------------


def _apply_patch_entry(objects: list[dict], entry: dict, directory: Path, kfile: Path) -> None:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise KustomizeError(f"{kfile}: patch fields not supported: {sorted(unknown)}")
    if ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{kfile}: a patch needs exactly one of path / patch")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    body = yaml.load(text, Loader=_LOADER)
    if isinstance(body, list):
        if "target" not in entry:
            raise KustomizeError(f"{kfile}: a JSON6902 patch needs a target")
        targets = _select(objects, entry["target"], kfile)
        for obj in targets:
            json6902(obj, body)
        return
    if not isinstance(body, dict) or "kind" not in body:
        raise KustomizeError(f"{kfile}: a strategic-merge patch must be a Kubernetes object")
    selector = entry.get("target") or {
        "kind": body["kind"],
        "name": (body.get("metadata") or {}).get("name"),
        "version": body["apiVersion"].split("/")[-1],
    }
    patch = {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
    patch["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items() if k not in ("name", "namespace")}
    if not patch["metadata"]:
        del patch["metadata"]
    for obj in _select(objects, selector, kfile):
        merged = strategic_merge(obj, patch)
        obj.clear()
        obj.update(merged)


def _select(objects: list[dict], target: dict, kfile: Path) -> list[dict]:
    unknown = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise KustomizeError(f"{kfile}: patch target fields not supported: {sorted(unknown)}")
    out = []
    for obj in objects:
        group, _, version = obj["apiVersion"].rpartition("/")
        meta = obj.get("metadata") or {}
        checks = {
            "group": group,
            "version": version,
            "kind": obj["kind"],
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace", ""),
        }
        if all(re.fullmatch(str(target[k]), checks[k]) for k in target if target[k] is not None):
            out.append(obj)
    if not out:
        raise KustomizeError(f"{kfile}: patch target {target} matches no object")
    return out


def strategic_merge(base: Any, patch: Any, path: str = "") -> Any:
    """The strategic-merge subset described in the module docstring; returns a new object."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"{path or '/'}: strategic-merge directives ($patch, ...) are not supported")
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out.get(key), value, f"{path}/{key}")
        return out
    if isinstance(patch, list):
        if any(isinstance(item, dict) for item in patch):
            raise KustomizeError(
                f"{path}: strategic merge of a list of mappings depends on merge keys; use a JSON6902 patch"
            )
        return copy.deepcopy(patch)
    return patch


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, dict):
            if part not in node:
                raise KustomizeError(f"JSON6902 path {path}: {part!r} does not exist")
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise KustomizeError(f"JSON6902 path {path}: index {part!r} out of range")
            node = node[int(part)]
        else:
            raise KustomizeError(f"JSON6902 path {path}: cannot descend into a scalar at {part!r}")
    return node


def json6902(doc: dict, operations: list[dict]) -> dict:
    """Apply RFC 6902 operations add/remove/replace/test/copy to `doc` in place (and return it)."""
    for op in operations:
        kind, path = op.get("op"), op.get("path")
        if kind not in ("add", "remove", "replace", "test", "copy") or path is None:
            raise KustomizeError(f"JSON6902 operation {op} not supported (add/remove/replace/test/copy with a path)")
        if kind == "copy":  # RFC 6902 4.5: an add of the value at `from`
            if "from" not in op:
                raise KustomizeError(f"JSON6902 copy to {path} needs `from`")
            op = {"op": "add", "path": path, "value": _walk(doc, _pointer(op["from"]), op["from"])}
            kind = "add"
        parts = _pointer(path)
        if not parts:
            raise KustomizeError("JSON6902 operations on the whole document are not supported")
        parent = _walk(doc, parts[:-1], path)
        last = parts[-1]
        if kind == "test":
            if _walk(doc, parts, path) != op["value"]:
                raise KustomizeError(f"JSON6902 test failed at {path}: {_walk(doc, parts, path)!r} != {op['value']!r}")
            continue
        value = copy.deepcopy(op.get("value"))
        if isinstance(parent, dict):
            if kind in ("remove", "replace") and last not in parent:
                raise KustomizeError(f"JSON6902 {kind} at {path}: {last!r} does not exist")
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = value
        elif isinstance(parent, list):
            if kind == "add" and last == "-":
                parent.append(value)
                continue
            if not last.isdigit() or int(last) > len(parent) or (kind != "add" and int(last) == len(parent)):
                raise KustomizeError(f"JSON6902 {kind} at {path}: index out of range")
            index = int(last)
            if kind == "add":
                parent.insert(index, value)
            elif kind == "remove":
                del parent[index]
            else:
                parent[index] = value
        else:
            raise KustomizeError(f"JSON6902 {kind} at {path}: parent is a scalar")
    return doc


# --- namespace, labels, images --------------------------------------------------------------------------------------


def _set_namespace(obj: dict, namespace: str) -> None:
    meta = obj.setdefault("metadata", {})
    if obj["kind"] == "Namespace":
        meta["name"] = namespace
        return
    if obj["kind"] not in _CLUSTER_SCOPED:
        meta["namespace"] = namespace
    if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        for subject in obj.get("subjects", []):
            if subject.get("name") == "default" and subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace


def _add_labels(objects: list[dict], entry: dict, kfile: Path) -> None:
    if set(entry) - {"pairs", "includeSelectors"} or entry.get("includeSelectors", False):
        raise KustomizeError(f"{kfile}: only labels with pairs and includeSelectors: false are supported")
    for obj in objects:
        labels = obj.setdefault("metadata", {}).setdefault("labels", {})
        labels.update({str(k): str(v) for k, v in entry["pairs"].items()})


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """'reg:5000/a/b:tag@sha256:..' -> ('reg:5000/a/b', 'tag', 'sha256:..'); a registry port is not a tag."""
    digest = None
    if "@" in image:
        image, digest = image.split("@", 1)
    name, tag = image, None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        name, tag = image[:colon], image[colon + 1 :]
    return name, tag, digest


def _set_image(objects: list[dict], entry: dict, kfile: Path) -> None:
    unknown = set(entry) - {"name", "newName", "newTag", "digest"}
    if unknown or "name" not in entry:
        raise KustomizeError(f"{kfile}: images entry needs a name; fields not supported: {sorted(unknown)}")

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        if isinstance(container, dict) and isinstance(container.get("image"), str):
                            container["image"] = _rewrite(container["image"])
                visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    def _rewrite(image: str) -> str:
        name, tag, digest = split_image(image)
        if name != entry["name"]:
            return image
        name = entry.get("newName", name)
        if "digest" in entry:
            return f"{name}@{entry['digest']}"
        tag = str(entry["newTag"]) if "newTag" in entry else tag
        out = f"{name}:{tag}" if tag else name
        return f"{out}@{digest}" if digest and "newTag" not in entry else out

    for obj in objects:
        visit(obj)
