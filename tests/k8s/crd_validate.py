"""Validate custom resources against a CRD's openAPIV3Schema the way the API server would, without a cluster.

Why each step: the API server first applies schema defaults (so `required` fields that have a default, such as
a worker group's minReplicas/maxReplicas, may be omitted), then validates. It silently prunes unknown fields,
which hides typos; ``kubectl apply`` (field validation Strict) rejects them instead, so the strict pass closes
every object schema (``additionalProperties: false``). ``x-kubernetes-list-type: map/set`` uniqueness (duplicate
env names, ports, ...) is checked too. CEL rules (``x-kubernetes-validations``) are not evaluated.
OpenAPI v3.0 schemas are draft-4 JSON Schema plus ``nullable``, hence Draft4Validator.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=8)
def load_crd(path: str) -> dict:
    """The CRD document of a file (cached: the KubeRay CRDs are ~1 MB of YAML each)."""
    docs = [d for d in yaml.load_all(Path(path).read_text(), Loader=_LOADER) if d]
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    if len(crds) != 1:
        raise ValueError(f"{path}: expected exactly one CustomResourceDefinition, found {len(crds)}")
    return crds[0]


def crd_schema(path: str | Path, version: str) -> dict:
    """openAPIV3Schema of `version` (which must be served) of the CRD in `path`."""
    crd = load_crd(str(path))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            if not entry.get("served", False):
                raise ValueError(f"{path}: version {version} is not served")
            return entry["schema"]["openAPIV3Schema"]
    raise ValueError(f"{path}: no version {version}")


def crd_kind(path: str | Path) -> tuple[str, str]:
    """(group, kind) the CRD defines."""
    crd = load_crd(str(path))
    return crd["spec"]["group"], crd["spec"]["names"]["kind"]


def apply_defaults(schema: dict, instance: Any) -> Any:
    """A copy of `instance` with every missing property that has a schema `default` filled in, recursively.

    Like the API server, defaults apply only inside objects that exist (a missing parent is not created).
    """
    instance = copy.deepcopy(instance)
    _default(schema, instance)
    return instance


def _default(schema: dict, node: Any) -> None:
    if isinstance(node, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in node and "default" in sub:
                node[key] = copy.deepcopy(sub["default"])
            if key in node:
                _default(sub, node[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in node.items():
                if key not in props:
                    _default(extra, value)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for item in node:
            _default(schema["items"], item)


@functools.lru_cache(maxsize=8)
def _strict_cached(path: str, version: str) -> dict:
    return strict_schema(crd_schema(path, version))


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` in which every object schema with properties rejects unknown fields."""
    out = copy.deepcopy(schema)
    _close(out)
    return out


def _close(schema: Any) -> None:
    if not isinstance(schema, dict):
        return
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        schema["type"] = [schema["type"], "null"]
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    for key in ("properties", "patternProperties"):
        for sub in (schema.get(key) or {}).values():
            _close(sub)
    for key in ("items", "additionalProperties", "not"):
        _close(schema.get(key))
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key) or []:
            _close(sub)


def list_type_errors(schema: dict, node: Any, path: str = "") -> list[str]:
    """Violations of x-kubernetes-list-type map (unique key tuples) and set (unique items)."""
    errors: list[str] = []
    if isinstance(node, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors.extend(list_type_errors(sub, value, f"{path}.{key}"))
    elif isinstance(node, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen = set()
            for item in node:
                ident = tuple(
                    repr(item.get(k, (items.get("properties") or {}).get(k, {}).get("default"))) for k in keys
                )
                if ident in seen:
                    errors.append(f"{path}: duplicate entry for list-map keys {keys} = {ident}")
                seen.add(ident)
        elif list_type == "set":
            reprs = [repr(item) for item in node]
            if len(set(reprs)) != len(reprs):
                errors.append(f"{path}: duplicate items in a list-type set")
        for i, item in enumerate(node):
            errors.extend(list_type_errors(items, item, f"{path}[{i}]"))
    return errors


def validate_custom_resource(obj: dict, crd_path: str | Path, *, strict: bool, defaults: bool = True) -> list[str]:
    """Every problem the API server (strict: with kubectl's Strict field validation) would report for `obj`."""
    group, kind = crd_kind(crd_path)
    api_group, _, version = obj.get("apiVersion", "").rpartition("/")
    if (api_group, obj.get("kind")) != (group, kind):
        return [f"object is {obj.get('apiVersion')}/{obj.get('kind')}, the CRD defines {group}/{kind}"]
    schema = _strict_cached(str(crd_path), version) if strict else crd_schema(crd_path, version)
    instance = apply_defaults(schema, obj) if defaults else obj
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in validator.iter_errors(instance)
    ]
    errors.extend(list_type_errors(schema, instance))
    return errors
