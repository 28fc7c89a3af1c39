"""Checkpoint directories: layout, atomic publish, listing, verification, and the ``train_state.json`` schema.

Layout of one checkpoint, ``<root>/<experiment>/step-000042/``::

    weights/          torch.distributed.checkpoint shards of {"model": ..., "optim": ...} (all ranks write)
    train_state.json  TrainState: counters, sampler / SFT sampler state, RNG states, per-rank worker state
    config.json       the pipeline config dump
    hf/               optional safetensors export (for vLLM/SGLang)
    manifest.json     lineage + sha256 of every other file + "complete": true, written last

Atomicity: everything is written into ``.step-000042.tmp-<uuid>`` beside the final name, fsynced, the manifest is
written last, and the directory is renamed in one ``os.replace``. Readers count only ``step-NNNNNN`` directories whose
manifest says ``complete: true``, so a crash at any moment leaves either the old set of checkpoints or the new one.

The driver writes a checkpoint in pieces (``rlpipe.train.run_state``): ``begin_checkpoint``, the ranks' DCP save
into ``weights/`` (``rlpipe.train.checkpoint_io``), ``write_train_state``, ``write_config``, ``finalize_checkpoint``
(or ``abort_checkpoint`` on failure). Weights of world size > 1 are written by each rank into the same directory, so
``root`` must be a filesystem all ranks share (single node, or NFS/Lustre); Flyte uploads the finished directory
afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlpipe.data.sampler import SamplerState
from rlpipe.errors import CheckpointError
from rlpipe.io import (
    atomic_write_json,
    fsync_dir,
    fsync_tree,
    inside_root,
    iter_files,
    local_path,
    sha256_file,
    sha256_files,
)
from rlpipe.train.lineage import MANIFEST_NAME, Manifest, architecture_diff, read_manifest

WEIGHTS_DIR = "weights"
TRAIN_STATE_NAME = "train_state.json"
CONFIG_NAME = "config.json"
HF_DIR = "hf"
REQUIRED_FILES = (TRAIN_STATE_NAME, f"{WEIGHTS_DIR}/.metadata")
STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_RE = re.compile(r"^\.(step-\d{6,})\.(tmp|old)-[0-9a-f]{32}$")
TRAIN_STATE_FORMAT = 2


# ----------------------------------------------------------------------------------------------- names and listing


def step_dir_name(step: int) -> str:
    """``step-000042``: zero-padded so lexical and numeric order agree up to a million steps."""
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step-{step:06d}"


def experiment_dir(root: str | os.PathLike[str], experiment: str | None = None) -> Path:
    """``<root>/<experiment>``, or ``root`` itself when ``experiment`` is None; refuses a name escaping ``root``."""
    return inside_root(root, experiment) if experiment is not None else local_path(root)


def _complete_manifest(path: Path) -> Manifest | None:
    """The manifest of ``path`` if it is a complete checkpoint whose step matches its name, else None."""
    m = STEP_RE.match(path.name)
    if m is None or not path.is_dir():
        return None
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    if not manifest.complete or manifest.step != int(m.group(1)):
        return None
    return manifest


def list_checkpoints(root: str | os.PathLike[str], experiment: str | None = None) -> list[Path]:
    """Complete checkpoints of an experiment, oldest step first. Temp, aborted and manifest-less dirs are skipped.

    Only the manifest is read (cheap); use ``verify_checkpoint`` before trusting the contents.
    """
    d = experiment_dir(root, experiment)
    if not d.is_dir():
        return []
    found = []
    for child in d.iterdir():
        manifest = _complete_manifest(child)
        if manifest is not None:
            found.append((manifest.step, child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike[str], experiment: str | None = None) -> Path | None:
    """Newest complete checkpoint by step, or None if there is none."""
    found = list_checkpoints(root, experiment)
    return found[-1] if found else None


def unusable_step_dirs(root: str | os.PathLike[str], experiment: str | None = None) -> list[Path]:
    """``step-NNNNNN`` entries that ``list_checkpoints`` skips: no, unreadable, incomplete or misnamed manifest."""
    d = experiment_dir(root, experiment)
    if not d.is_dir():
        return []
    return sorted(c for c in d.iterdir() if STEP_RE.match(c.name) and _complete_manifest(c) is None)


def resume_point(root: str | os.PathLike[str], experiment: str | None = None) -> Path | None:
    """The newest complete checkpoint to resume from, or None when the experiment has no step dir at all.

    Why not ``latest_checkpoint``: it skips a step dir it cannot read, so a resume after the newest checkpoint was
    corrupted would silently start over (or continue from an older step), losing the work without a word. Any
    ``step-NNNNNN`` entry that is not a complete checkpoint is a CheckpointError that names it and says what to do.
    """
    bad = unusable_step_dirs(root, experiment)
    if bad:
        good = latest_checkpoint(root, experiment)
        then = f"the newest complete checkpoint, {good}" if good else "the base model (there is no complete one)"
        raise CheckpointError(
            f"{', '.join(map(str, bad))}: looks like a checkpoint but is not a complete one (missing, unreadable or "
            "incomplete manifest.json, or a manifest for another step); refusing to resume past it. Inspect it, "
            f"then move it out of {experiment_dir(root, experiment)} (or rename it so it no longer matches "
            f"step-NNNNNN) to resume from {then}, or start from an explicit older checkpoint "
            "(the workflow's `checkpoint` input)"
        )
    return latest_checkpoint(root, experiment)


# ------------------------------------------------------------------------------------------------ atomic publish


def begin_checkpoint(root: str | os.PathLike[str], experiment: str, step: int) -> Path:
    """Create and return the temp dir ``<root>/<experiment>/.step-NNNNNN.tmp-<uuid>`` to write a checkpoint into."""
    parent = experiment_dir(root, experiment)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{step_dir_name(step)}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    return tmp


def _final_for(tmp_dir: Path) -> Path:
    m = _TMP_RE.match(tmp_dir.name)
    if m is None or m.group(2) != "tmp":
        raise CheckpointError(f"{tmp_dir} is not a checkpoint temp dir made by begin_checkpoint")
    return tmp_dir.parent / m.group(1)


def abort_checkpoint(tmp_dir: str | os.PathLike[str]) -> None:
    """Delete an unfinished temp dir (refuses anything not named like one, so a real checkpoint is never removed)."""
    tmp = local_path(tmp_dir)
    _final_for(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def finalize_checkpoint(
    tmp_dir: str | os.PathLike[str], manifest: Manifest, exists: Literal["error", "replace"] = "error"
) -> Path:
    """Checksum every file, write manifest.json last, fsync, and rename the temp dir to ``step-NNNNNN``.

    ``manifest.step`` must match the temp dir's step; ``files`` and ``complete`` are filled in here.
    If ``step-NNNNNN`` already exists: ``exists="error"`` raises CheckpointError; ``"replace"`` moves the old dir
    to a hidden ``.step-NNNNNN.old-<uuid>`` name, renames the new one in, then deletes the old one. During that
    swap the step is briefly absent (readers fall back to the previous step), never half-written.
    On failure the temp dir is left in place (pass it to ``abort_checkpoint``); no final dir is created.
    """
    tmp = local_path(tmp_dir)
    final = _final_for(tmp)
    if step_dir_name(manifest.step) != final.name:
        raise CheckpointError(f"manifest is for step {manifest.step} but the temp dir {tmp.name} is for {final.name}")
    if not tmp.is_dir():
        raise CheckpointError(f"checkpoint temp dir {tmp} does not exist")
    (tmp / MANIFEST_NAME).unlink(missing_ok=True)
    files = sha256_files(tmp, skip=[MANIFEST_NAME])
    fsync_tree(tmp)
    done = manifest.model_copy(update={"files": files, "complete": True})
    atomic_write_json(tmp / MANIFEST_NAME, done.model_dump(mode="json"))
    parent = final.parent
    if final.exists():
        if exists != "replace":
            state = "complete" if _complete_manifest(final) is not None else "incomplete"
            raise CheckpointError(f"checkpoint {final} already exists ({state}); pass exists='replace' to overwrite")
        old = parent / f".{final.name}.old-{uuid.uuid4().hex}"
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)
            raise
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return final
    try:
        os.replace(tmp, final)
    except OSError as e:  # a concurrent writer published the same step first (ENOTEMPTY/EEXIST)
        if final.exists():
            raise CheckpointError(f"checkpoint {final} appeared while finalizing (concurrent writer?)") from e
        raise
    fsync_dir(parent)
    return final


def remove_stale_temp_dirs(
    root: str | os.PathLike[str], experiment: str | None = None, older_than_s: float = 3600.0
) -> list[Path]:
    """Delete ``.step-*.tmp-*`` / ``.step-*.old-*`` dirs left by crashed writers, if untouched for ``older_than_s``.

    The age guard keeps it safe to call while another process is still writing a checkpoint.
    """
    d = experiment_dir(root, experiment)
    removed = []
    if not d.is_dir():
        return removed
    now = time.time()
    for child in d.iterdir():
        if _TMP_RE.match(child.name) and child.is_dir() and now - child.stat().st_mtime >= older_than_s:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


# ------------------------------------------------------------------------------------------------- verification


def _check_relpath(rel: str, where: Path) -> None:
    if rel.startswith("/") or ".." in Path(rel).parts:
        raise CheckpointError(f"manifest of {where} lists an unsafe path {rel!r}")


def verify_checkpoint(
    path: str | os.PathLike[str],
    expect_model_fingerprint: str | None = None,
    *,
    expect_model_name: str | None = None,
    expect_architecture: dict[str, Any] | None = None,
    expect_weights_sha256: str | None = None,
    required: tuple[str, ...] = REQUIRED_FILES,
) -> Manifest:
    """Check a checkpoint before use and return its manifest; any problem is a CheckpointError naming it.

    Checks: manifest present, valid and ``complete``; step matches a ``step-NNNNNN`` dir name; the ``required`` files
    are listed; every listed file exists with its sha256; no unlisted file under ``weights/``; and, if given,
    ``expect_model_fingerprint`` equals the manifest's base model fingerprint (``lineage.model_fingerprint``).
    ``expect_architecture`` (``lineage.model_architecture`` of this run's model) lets that error name the fields
    that differ. ``expect_weights_sha256`` (``lineage.model_weights_sha256``; LoRA runs, whose checkpoints hold only
    adapters) must equal the manifest's base weights hash.
    """
    ckpt = local_path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} does not exist or is not a directory")
    manifest = read_manifest(ckpt)
    if not manifest.complete:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete (manifest says complete: false)")
    m = STEP_RE.match(ckpt.name)
    if m is not None and int(m.group(1)) != manifest.step:
        raise CheckpointError(
            f"checkpoint {ckpt} is named for step {int(m.group(1))} but its manifest says {manifest.step}"
        )
    for rel in required:
        if rel not in manifest.files:
            raise CheckpointError(f"checkpoint {ckpt} lacks required file {rel}")
    for rel, digest in sorted(manifest.files.items()):
        _check_relpath(rel, ckpt)
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt}: file {rel} listed in the manifest is missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"checkpoint {ckpt}: file {rel} does not match its sha256 (corrupted or tampered)")
    if TRAIN_STATE_NAME in manifest.files:
        _check_state_matches(ckpt, manifest)
    weights = ckpt / WEIGHTS_DIR
    if weights.is_dir():
        unlisted = [f"{WEIGHTS_DIR}/{r}" for r in iter_files(weights) if f"{WEIGHTS_DIR}/{r}" not in manifest.files]
        if unlisted:
            raise CheckpointError(f"checkpoint {ckpt}: unlisted file(s) in weights/: {', '.join(unlisted)}")
    if expect_model_fingerprint is not None:
        have = manifest.base_model.fingerprint
        if have != expect_model_fingerprint:
            mine = f"{expect_model_name} " if expect_model_name else ""
            diff = architecture_diff(manifest.base_model.architecture, expect_architecture)
            raise CheckpointError(
                f"checkpoint {ckpt} ({MANIFEST_NAME}) was written for model {manifest.base_model.path} "
                f"(fingerprint {have[:12] if have else 'none'}), this run uses {mine}"
                f"(fingerprint {expect_model_fingerprint[:12]})" + (f": {diff}" if diff else "")
            )
    if expect_weights_sha256 is not None and manifest.base_model.weights_sha256 != expect_weights_sha256:
        have = manifest.base_model.weights_sha256
        raise CheckpointError(
            f"checkpoint {ckpt} ({MANIFEST_NAME}) holds LoRA adapters trained on the base weights of "
            f"{manifest.base_model.path} (weights sha256 {have[:12] if have else 'not recorded'}), but this run's "
            f"base {expect_model_name or ''} has weights sha256 {expect_weights_sha256[:12]}: the adapters would "
            "apply to other weights. Resume with the same model.path."
        )
    return manifest


def _check_state_matches(ckpt: Path, manifest: Manifest) -> None:
    """train_state.json must be of this schema and at the manifest's iteration and step (else a resume repeats or
    skips iterations: counters, samplers and LR would not match the weights)."""
    counters = load_train_state(ckpt).counters
    for name in ("iteration", "step"):
        have, want = getattr(counters, name), getattr(manifest, name)
        if have != want:
            raise CheckpointError(
                f"checkpoint {ckpt}: {TRAIN_STATE_NAME} says counters.{name}={have} but {MANIFEST_NAME} says "
                f"{name}={want}; the two files disagree"
            )


# ---------------------------------------------------------------------------------------------------- train state


class Counters(BaseModel):
    """How far a run is: the one counter schema of the session, ``train_state.json`` and the Flyte types.

    Strict: a counter written as a string or a float is a corrupt state file, not a number to coerce."""

    model_config = ConfigDict(extra="forbid", strict=True)

    iteration: int = Field(0, ge=0, description="RL iterations completed.")
    step: int = Field(0, ge=0, description="Optimizer steps taken (RL and SFT): the weights' version.")
    consumed_prompts: int = Field(0, ge=0, description="Prompts whose rollouts were trained on.")
    consumed_tokens: int = Field(0, ge=0, description="Training tokens consumed.")
    sft_steps: int = Field(0, ge=0, description="SFT steps taken.")


class TrainState(BaseModel):
    """Contents of ``train_state.json``: everything besides weights needed to resume bit-for-bit.

    Format 1 (rlpipe before the counters were unified) is read too: its flat ``step``, ``consumed_samples``,
    ``sampler_state``, ``sft_loader_state`` and ``extra.sft_steps`` map onto this schema (`_from_format_1`).
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal[2] = Field(TRAIN_STATE_FORMAT, description="Schema version of this file.")
    counters: Counters = Field(default_factory=Counters, description="Where the run is.")
    sampler: SamplerState | None = Field(None, description="The prompt sampler's position (EpochSampler.state).")
    sft_sampler: SamplerState | None = Field(None, description="The SFT sampler's position, when SFT is on.")
    rng_states: list[dict[str, Any]] = Field(
        default_factory=list, description="The driver's capture_rng_state() (one entry)."
    )
    worker_states: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per-rank JSON state returned by each training worker (counters, its RNG state), index = rank.",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Other JSON state (e.g. pending rollouts).")

    @model_validator(mode="before")
    @classmethod
    def _from_format_1(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "format" in data:
            return data
        old = dict(data)
        extra = dict(old.pop("extra", None) or {})
        counters = {
            "iteration": old.pop("iteration", 0),
            "step": old.pop("step", 0),
            "consumed_prompts": old.pop("consumed_samples", 0),
            "consumed_tokens": old.pop("consumed_tokens", 0),
            "sft_steps": extra.pop("sft_steps", 0),
        }
        old.pop("epoch", None)  # the sampler's own epoch says the same
        return {"format": TRAIN_STATE_FORMAT, "counters": counters, "sampler": old.pop("sampler_state", None),
                "sft_sampler": old.pop("sft_loader_state", None), "extra": extra, **old}  # fmt: skip


def write_train_state(ckpt_dir: str | os.PathLike[str], state: TrainState) -> Path:
    """Write ``train_state.json`` atomically into a (temp) checkpoint dir."""
    return atomic_write_json(local_path(ckpt_dir) / TRAIN_STATE_NAME, state.model_dump(mode="json"))


def write_config(ckpt_dir: str | os.PathLike[str], config: Any) -> Path:
    """Write the pipeline config dump (dict or pydantic model) as ``config.json``."""
    return atomic_write_json(local_path(ckpt_dir) / CONFIG_NAME, config)


def load_train_state(path: str | os.PathLike[str]) -> TrainState:
    """Read ``train_state.json`` (a checkpoint dir or the file). Anything not JSON is refused, never unpickled."""
    p = local_path(path)
    f = p / TRAIN_STATE_NAME if p.is_dir() else p
    try:
        raw = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"train state {f} not found") from None
    hint = ""
    if raw[:1] == b"\x80":
        hint = " (it looks like a pickle)"
    elif raw[:4] == b"PK\x03\x04":
        hint = " (it looks like a torch.save zip)"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"train state {f} is not JSON{hint}; rlpipe never unpickles state files") from None
    try:
        return TrainState.model_validate(obj)
    except ValidationError as e:
        raise CheckpointError(f"train state {f} does not match the TrainState schema: {e}") from None
