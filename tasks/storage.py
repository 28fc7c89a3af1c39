"""Where checkpoints live between tasks: a filesystem root (local dir or shared volume) or an object-store URI.

rlpipe writes local paths only. Two deployments are supported:
- `checkpoint.root` is a path (a local run, or a ReadWriteMany volume mounted in every Ray pod, k8s/base/pvc.yaml):
  checkpoints are written there in place and a later task or a cron run finds them with `latest_checkpoint`;
- `checkpoint.root` is a URI (`s3://bucket/ckpt`, `gs://...`): tasks write into a local scratch root, then mirror the
  finished checkpoint to `<root>/<experiment>/step-NNNNNN/` with manifest.json uploaded last, so a reader that
  trusts only `complete: true` manifests never sees half a checkpoint there either.
Both work on open-source Flyte: resuming needs only a listing of the root, not an Artifact query.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path

from rlpipe.config import PipelineConfig
from rlpipe.errors import CheckpointError
from rlpipe.io import check_name
from rlpipe.train.checkpoint import STEP_RE, latest_checkpoint, resume_point
from rlpipe.train.lineage import MANIFEST_NAME, lineage_chain, read_manifest
from tasks.types import Checkpoint

SCRATCH_DIR = ".rlpipe-scratch"


def is_uri(path: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path)) and not path.startswith("file://")


def _fs(uri: str):
    from flytekit.core.context_manager import FlyteContextManager

    return FlyteContextManager.current_context().file_access.get_filesystem_for_path(uri)


def working_config(cfg: PipelineConfig) -> tuple[PipelineConfig, str | None]:
    """The config the engine runs with (a local checkpoint root) and the remote root to mirror to, if any."""
    root = cfg.checkpoint.root
    if not is_uri(root):
        return cfg, None
    local = cfg.model_copy(deep=True)
    local.checkpoint.root = str(Path(SCRATCH_DIR).absolute() / "checkpoints")
    return local, root.rstrip("/")


def latest_location(cfg: PipelineConfig) -> str | None:
    """Newest complete checkpoint of the experiment under the root (path or URI), or None."""
    root = cfg.checkpoint.root.rstrip("/")
    if not is_uri(root):
        found = latest_checkpoint(root, cfg.experiment)
        return str(found.absolute()) if found is not None else None
    return _scan_remote(root, cfg.experiment)[0]


def resume_location(cfg: PipelineConfig) -> str | None:
    """What `resume=True` starts from: the newest complete checkpoint, or None when there is no step dir at all.

    A step dir that is not a complete checkpoint is a CheckpointError naming it (`checkpoint.resume_point`), so a
    resume never silently starts over from the base model or an older step.
    """
    root = cfg.checkpoint.root.rstrip("/")
    if not is_uri(root):
        found = resume_point(root, cfg.experiment)
        return str(found.absolute()) if found is not None else None
    best, bad = _scan_remote(root, cfg.experiment)
    if bad:
        raise CheckpointError(
            f"{', '.join(bad)}: looks like a checkpoint but is not a complete one (no readable complete "
            "manifest.json for its step); refusing to resume past it. Inspect it, then remove it to resume from "
            f"{best or 'the base model'}, or start from an explicit older checkpoint (the `checkpoint` input)"
        )
    return best


def _scan_remote(root: str, experiment: str) -> tuple[str | None, list[str]]:
    """(newest complete step dir, step dirs that are not complete checkpoints) under an object-store root."""
    fs, base = _fs(root), posixpath.join(root, experiment)
    if not fs.exists(base):
        return None, []
    best: tuple[int, str] | None = None
    bad: list[str] = []
    for entry in fs.ls(base, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        m = STEP_RE.match(name)
        if m is None:
            continue
        uri = posixpath.join(base, name)
        try:
            manifest = json.loads(fs.cat_file(posixpath.join(uri, MANIFEST_NAME)))
        except (FileNotFoundError, OSError, ValueError):
            bad.append(uri)
            continue
        if not (
            isinstance(manifest, dict) and manifest.get("complete") is True and manifest.get("step") == int(m.group(1))
        ):
            bad.append(uri)
        elif best is None or best[0] < int(m.group(1)):
            best = (int(m.group(1)), uri)
    return (best[1] if best else None), sorted(bad)


def describe(location: str) -> Checkpoint:
    """A Checkpoint value for a complete checkpoint at a local path or URI (downloads only manifest + state)."""
    if not is_uri(location):
        return Checkpoint.from_dir(location, uri=location)
    from flytekit.types.directory import FlyteDirectory

    local = Path(SCRATCH_DIR).absolute() / "meta" / posixpath.basename(location)
    local.mkdir(parents=True, exist_ok=True)
    fs = _fs(location)
    for name in (MANIFEST_NAME, "train_state.json"):
        fs.get_file(posixpath.join(location, name), str(local / name))
    ckpt = Checkpoint.from_dir(local, uri=location, check_complete=False)
    ckpt.path = FlyteDirectory(location)
    return ckpt


def publish(
    local_dir: str, cfg: PipelineConfig, remote_root: str | None, aliases: dict[str, str] | None = None
) -> Checkpoint:
    """Make a finished local checkpoint durable where the user's `checkpoint.root` says, and describe it.

    `cfg` is the working config (local root); `aliases` maps local copies (downloads) to their canonical locations,
    so the manifest's `parent` names the canonical parent, not a temp dir. Only manifest.json is rewritten (it is
    not in its own file list), before anything is uploaded.
    """
    if remote_root is None:
        return Checkpoint.from_dir(local_dir, uri=str(Path(local_dir).absolute()))
    _canonical_parent(Path(local_dir), Path(cfg.checkpoint.root).absolute(), remote_root, aliases or {})
    name = Path(local_dir).name
    experiment = read_manifest(local_dir).experiment
    try:
        check_name(experiment, f"experiment of {local_dir}/{MANIFEST_NAME}")  # it becomes an object-store key
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    target = posixpath.join(remote_root, experiment, name)
    fs = _fs(target)
    files = sorted(p for p in Path(local_dir).rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    for path in [*files, Path(local_dir) / MANIFEST_NAME]:  # manifest last: it marks the checkpoint complete
        fs.put_file(str(path), posixpath.join(target, path.relative_to(local_dir).as_posix()))
    return describe(target)


def _canonical_parent(ckpt_dir: Path, scratch_root: Path, remote_root: str, aliases: dict[str, str]) -> None:
    from rlpipe.io import atomic_write_json

    path = ckpt_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    parent = manifest.get("parent")
    if not parent or is_uri(parent):
        return
    real = os.path.realpath(parent if os.path.isabs(parent) else ckpt_dir / parent)
    new = {os.path.realpath(k): v for k, v in aliases.items()}.get(real)
    if new is None and Path(real).is_relative_to(scratch_root):
        new = posixpath.join(remote_root, Path(real).relative_to(scratch_root).as_posix())
    if new is not None:
        manifest["parent"] = new
        atomic_write_json(path, manifest)


def materialize(ckpt: Checkpoint | None) -> str | None:
    """A local directory with the checkpoint's files: its canonical path when this machine sees it, else a download."""
    if ckpt is None:
        return None
    if ckpt.uri and not is_uri(ckpt.uri) and (Path(ckpt.uri) / MANIFEST_NAME).is_file():
        return ckpt.uri
    return str(ckpt.path.download())


def descends_from(location: str, ancestor: str | None) -> bool:
    """True when `ancestor` (None = the base model) is on the lineage chain of the checkpoint at `location`."""
    chain = lineage_chain(location)
    if ancestor is None:
        return chain.missing_parent is None and chain.entries[-1].manifest.parent is None
    want = os.path.realpath(ancestor) if not is_uri(ancestor) else ancestor.rstrip("/")
    for entry in chain.entries:
        loc = entry.location
        if (os.path.realpath(loc) if not is_uri(loc) else loc.rstrip("/")) == want:
            return True
    return False
