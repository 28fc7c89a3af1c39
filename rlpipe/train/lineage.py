"""Checkpoint manifests and lineage: where a checkpoint came from, and the chain of its ancestors.

Every checkpoint directory holds ``manifest.json`` (a ``Manifest``). Open-source Flyte keeps artifact lineage only
as metadata, so rlpipe keeps its own: the parent checkpoint, the data it was trained on (with hashes), the config
hash and code version. ``lineage_chain`` walks parents from any local path or fsspec URI (s3://, gs://, file://),
so lineage can be browsed wherever the checkpoints were uploaded.

``parent`` is stored as given: an absolute path, a URI, or a path *relative to the child's directory*
(e.g. ``../step-000041``); relative parents keep a chain intact when a whole experiment directory is copied.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import rlpipe
from rlpipe.errors import CheckpointError
from rlpipe.io import read_json, stable_hash

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
# Model-config keys that define the weight shapes/semantics; anything else (dtype, attn impl) may change freely.
FINGERPRINT_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


class BaseModelRef(BaseModel):
    """The model a checkpoint chain started from."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Absolute path or URI of the base model directory (HF format).")
    fingerprint: str | None = Field(
        default=None, description="model_fingerprint() of its config: guards against resuming onto another model."
    )
    architecture: dict[str, Any] | None = Field(
        default=None,
        description="model_architecture() of its config (the values the fingerprint hashes), so a mismatch on resume "
        "names the differing field; null in checkpoints written before it was recorded.",
    )
    weights_sha256: str | None = Field(
        default=None,
        description="model_weights_sha256() of its weight files. Recorded by LoRA runs (model.lora), whose "
        "checkpoints hold only the adapters: they resume only onto the very base weights they were trained on.",
    )


class DataRef(BaseModel):
    """One input data set or batch that went into the step that wrote the checkpoint."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Role of the data, e.g. 'prompts', 'rollout-7', 'sft'.")
    path: str = Field(description="Path or URI of the data file or directory.")
    sha256: str | None = Field(default=None, description="Content hash (sha256_file / sha256_tree); null if unknown.")


class ServedRef(BaseModel):
    """Which weights a server engine served for a run of rollouts (rollout.engine = vllm/sglang/openai)."""

    model_config = ConfigDict(extra="forbid")

    iterations: str = Field(description="RL iterations whose rollouts it produced, e.g. '3-7'.")
    engine: str = Field(description="Engine and address, e.g. 'vllm http://127.0.0.1:8000'.")
    weight_versions: list[int] = Field(
        description="Policy version (optimizer step) served per iteration, verified by the sync probe; -1 = never "
        "synced (engine=openai serves the weights it was started with)."
    )


class CodeVersion(BaseModel):
    """Which rlpipe code wrote the checkpoint."""

    model_config = ConfigDict(extra="forbid")

    rlpipe: str = Field(description="rlpipe.__version__.")
    git_commit: str | None = Field(default=None, description="`git rev-parse HEAD` of the source tree, if any.")


class Manifest(BaseModel):
    """Contents of ``manifest.json``: lineage plus the per-file checksums that make a checkpoint verifiable."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = Field(default=FORMAT_VERSION, description="Manifest schema version.")
    experiment: str = Field(description="Experiment name; checkpoints live under <root>/<experiment>/.")
    step: int = Field(ge=0, description="Optimizer step count at save time; the directory is step-<step:06d>.")
    iteration: int = Field(ge=0, description="RL iteration (rollout+train round) at save time.")
    phase: str | None = Field(default=None, description="Phase that wrote it ('train', 'sft', ...), informational.")
    parent: str | None = Field(
        default=None, description="Parent checkpoint: absolute path, URI, or path relative to this checkpoint dir."
    )
    parent_weights_only: bool = Field(
        default=False,
        description="True when only the parent's weights were taken (checkpoint.init_from: a new stage with a fresh "
        "optimizer, counters and samplers); False when this checkpoint continues the parent's run.",
    )
    base_model: BaseModelRef = Field(description="Base model the chain started from.")
    data: list[DataRef] = Field(default_factory=list, description="Data consumed since the parent checkpoint.")
    served: list[ServedRef] = Field(
        default_factory=list, description="Weights the rollout server served since the parent (server engines)."
    )
    config_hash: str | None = Field(default=None, description="stable_hash() of the pipeline config dump.")
    code_version: CodeVersion = Field(description="rlpipe version and git commit.")
    created_at: str = Field(description="UTC creation time, ISO 8601.")
    files: dict[str, str] = Field(
        default_factory=dict, description="{relative path: sha256} of every file except manifest.json."
    )
    complete: bool = Field(default=False, description="True only once every listed file was written and fsynced.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Summary metrics of the step (optional).")


def model_architecture(config: Any) -> dict[str, Any]:
    """The architecture-defining keys of a model config (``FINGERPRINT_KEYS``; a missing key is None).

    Accepts a dict, an object with ``to_dict()`` (transformers PretrainedConfig) or a model directory / config.json
    path.
    """
    if isinstance(config, str | os.PathLike):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        config = read_json(p, what="model config", error=CheckpointError)
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise CheckpointError(f"model config must be a dict, got {type(config).__name__}")
    return {k: config.get(k) for k in FINGERPRINT_KEYS}


def model_fingerprint(config: Any) -> str:
    """sha256 of ``model_architecture(config)``: two configs differ only if a shape-relevant key differs."""
    return stable_hash(model_architecture(config))


def model_weights_sha256(model_dir: str | os.PathLike[str]) -> str:
    """sha256 over the base model's ``*.safetensors`` (names and contents): same architecture is not same weights."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model directory {model_dir} has no *.safetensors to fingerprint")
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _weights_sha256(str(Path(model_dir).resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _weights_sha256(model_dir: str, stamp: tuple) -> str:  # `stamp` (names, sizes, mtimes) invalidates the cache
    from rlpipe.io import sha256_file

    return stable_hash({name: sha256_file(Path(model_dir) / name) for name, _, _ in stamp})


def architecture_diff(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> str:
    """``"hidden_size: 64 in the checkpoint, 32 here; ..."`` for the keys that differ ("" if unknown or none)."""
    if not saved or not current:
        return ""
    diffs = [
        f"{k}: {json.dumps(saved.get(k))} in the checkpoint, {json.dumps(current.get(k))} here"
        for k in FINGERPRINT_KEYS
        if saved.get(k) != current.get(k)
    ]
    return "; ".join(diffs)


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    """HEAD commit of the repo holding the rlpipe package, or None (no git, not a repo, no commits yet)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(rlpipe.__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if out.returncode != 0 or len(commit) != 40:
        return None
    return commit


def code_version() -> CodeVersion:
    """Current rlpipe version and git commit (null when unavailable)."""
    return CodeVersion(rlpipe=rlpipe.__version__, git_commit=_git_commit())


def build_manifest(
    *,
    experiment: str,
    step: int,
    iteration: int,
    base_model: BaseModelRef | dict[str, Any],
    parent: str | os.PathLike[str] | None = None,
    data: list[DataRef | dict[str, Any]] | None = None,
    served: list[ServedRef | dict[str, Any]] | None = None,
    config: Any = None,
    metrics: dict[str, float] | None = None,
    phase: str | None = None,
    parent_weights_only: bool = False,
) -> Manifest:
    """A not-yet-complete Manifest with config_hash, code_version and created_at filled in.

    ``finalize_checkpoint`` adds ``files`` and sets ``complete``. ``config`` is hashed with ``stable_hash``
    (pydantic models are dumped first); pass None to leave config_hash null.
    """
    return Manifest(
        experiment=experiment,
        step=step,
        iteration=iteration,
        phase=phase,
        parent=None if parent is None else os.fspath(parent),
        parent_weights_only=parent_weights_only,
        base_model=base_model,
        data=list(data or []),
        served=list(served or []),
        config_hash=None if config is None else stable_hash(config),
        code_version=code_version(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        metrics={k: float(v) for k, v in (metrics or {}).items()},
    )


def _is_uri(loc: str) -> bool:
    return "://" in loc


def _split_manifest_location(loc: str) -> tuple[str, str]:
    """(checkpoint dir location, manifest file location) for a dir or a manifest.json path/URI."""
    loc = os.fspath(loc)
    stripped = loc.rstrip("/")
    if stripped.endswith("/" + MANIFEST_NAME) or stripped == MANIFEST_NAME:
        return (posixpath.dirname(stripped) or "."), stripped
    if _is_uri(loc):
        return stripped, stripped + "/" + MANIFEST_NAME
    return stripped, os.path.join(stripped, MANIFEST_NAME)


def resolve_parent(child_dir: str, parent: str) -> str:
    """Location of ``parent`` as seen from the checkpoint at ``child_dir`` (relative parents join onto it)."""
    if _is_uri(parent) or os.path.isabs(parent):
        return parent
    if _is_uri(child_dir):
        scheme, rest = child_dir.split("://", 1)
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, parent))}"
    return os.path.normpath(os.path.join(child_dir, parent))


def read_manifest(path_or_uri: str | os.PathLike[str]) -> Manifest:
    """Read and validate the manifest of a checkpoint dir (or a manifest.json) from a local path or fsspec URI."""
    _dir, loc = _split_manifest_location(os.fspath(path_or_uri))
    try:
        if _is_uri(loc):
            import fsspec

            with fsspec.open(loc, "rb") as f:
                raw = f.read()
        else:
            raw = Path(loc).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no manifest at {loc}: not a (complete) rlpipe checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"cannot read manifest {loc}: {e}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"manifest {loc} is not valid JSON: {e}") from None
    try:
        return Manifest.model_validate(obj)
    except ValidationError as e:
        raise CheckpointError(f"manifest {loc} does not match the manifest schema: {e}") from None


@dataclass
class LineageEntry:
    """One checkpoint in a chain: where it was read from and its manifest."""

    location: str
    manifest: Manifest


@dataclass
class LineageChain:
    """Checkpoints from the requested one back to the root (newest first), plus why the walk stopped early.

    Iterating, indexing and ``len`` act on the manifests, so it reads like ``list[Manifest]``.
    """

    entries: list[LineageEntry] = field(default_factory=list)
    missing_parent: str | None = None  # location of a parent that could not be read (chain ends before it)
    note: str | None = None  # human-readable reason: missing parent, cycle, or max_depth reached

    @property
    def manifests(self) -> list[Manifest]:
        return [e.manifest for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.manifests)

    def __getitem__(self, i: int) -> Manifest:
        return self.entries[i].manifest


def lineage_chain(
    path_or_uri: str | os.PathLike[str], max_depth: int = 1000, until: Callable[[str], bool] | None = None
) -> LineageChain:
    """Follow ``parent`` links from a checkpoint; never raises for ancestors.

    The starting checkpoint must be readable (else CheckpointError). An unreadable parent sets ``missing_parent``
    and ``note``; a cycle or ``max_depth`` stops the walk with a ``note``. ``until(location)`` True stops the walk
    before that parent is read (it is not in the chain).
    """
    loc = _split_manifest_location(os.fspath(path_or_uri))[0]
    chain = LineageChain(entries=[LineageEntry(loc, read_manifest(loc))])
    seen = {_norm(loc)}
    while True:
        parent = chain.entries[-1].manifest.parent
        if parent is None:
            return chain
        ploc = resolve_parent(chain.entries[-1].location, parent)
        if until is not None and until(ploc):
            return chain
        if _norm(ploc) in seen:
            chain.note = f"cycle: parent {ploc} already appears in the chain"
            return chain
        if len(chain.entries) >= max_depth:
            chain.note = f"stopped at max_depth={max_depth}; next parent {ploc}"
            return chain
        try:
            manifest = read_manifest(ploc)
        except CheckpointError as e:
            chain.missing_parent = ploc
            chain.note = f"parent {ploc} could not be read: {e}"
            return chain
        seen.add(_norm(ploc))
        chain.entries.append(LineageEntry(ploc, manifest))


def _norm(loc: str) -> str:
    """Comparable form of a location (for cycle detection)."""
    if loc.startswith("file://"):
        loc = loc[len("file://") :]
    return loc if _is_uri(loc) else os.path.realpath(loc)


def _short(h: str | None, n: int = 12) -> str:
    return "-" if h is None else h[:n]


def format_lineage(chain: LineageChain, fmt: Literal["text", "json"] = "text") -> str:
    """Render a chain: ``text`` is one block per checkpoint (newest first); ``json`` is a parseable document."""
    if fmt == "json":
        doc = {
            "chain": [{"location": e.location, "manifest": e.manifest.model_dump(mode="json")} for e in chain.entries],
            "missing_parent": chain.missing_parent,
            "note": chain.note,
        }
        return json.dumps(doc, indent=2, sort_keys=True)
    if fmt != "text":
        raise ValueError(f"fmt must be 'text' or 'json', got {fmt!r}")
    blocks = []
    for e in chain.entries:
        m = e.manifest
        data = ", ".join(f"{d.name}={_short(d.sha256)}" for d in m.data) or "-"
        code = m.code_version.rlpipe + (f" @ {_short(m.code_version.git_commit)}" if m.code_version.git_commit else "")
        lines = [
            f"step {m.step} (iteration {m.iteration}, experiment {m.experiment}"
            + (f", phase {m.phase}" if m.phase else "")
            + (")" if m.complete else ", INCOMPLETE)"),
            f"  path:     {e.location}",
            f"  parent:   {m.parent or '-'}"
            + (" (weights only: checkpoint.init_from)" if m.parent_weights_only else ""),
            f"  base:     {m.base_model.path} (fingerprint {_short(m.base_model.fingerprint)})",
            f"  data:     {data}",
            f"  config:   {_short(m.config_hash)}",
            f"  code:     {code}",
            f"  created:  {m.created_at}",
        ]
        if m.metrics:
            lines.append("  metrics:  " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(m.metrics.items())))
        blocks.append("\n".join(lines))
    if chain.note:
        blocks.append(f"(chain ends: {chain.note})")
    return "\n\n".join(blocks) + "\n"
