"""Checkpoint directories: atomic publish, DCP weights, JSON train state, RNG state, verification.

Layout of one checkpoint, ``<root>/<experiment>/step-000042/``::

    weights/          torch.distributed.checkpoint shards of {"model": ..., "optim": ...} (all ranks write)
    train_state.json  TrainState: counters, sampler / SFT loader state, per-rank RNG states
    config.json       the pipeline config dump
    hf/               optional safetensors export (for vLLM/SGLang)
    manifest.json     lineage + sha256 of every other file + "complete": true, written last

Atomicity: everything is written into ``.step-000042.tmp-<uuid>`` beside the final name, fsynced, the manifest is
written last, and the directory is renamed in one ``os.replace``. Readers count only ``step-NNNNNN`` directories whose
manifest says ``complete: true``, so a crash at any moment leaves either the old set of checkpoints or the new one.

Two ways to use it:

- collective one-liners ``save_checkpoint`` / ``load_checkpoint``, called by every rank with the same arguments;
- the pieces (``begin_checkpoint``, ``save_dcp``, ``write_train_state``, ``finalize_checkpoint``, ...).

Weights of world size > 1 are written by each rank into the same directory, so ``root`` must be a filesystem all
ranks share (single node, or NFS/Lustre); Flyte uploads the finished directory afterwards.

Another world size: DCP records every tensor with its global shape, so a checkpoint written by N ranks (FSDP2
DTensor shards, or replicated plain tensors deduplicated to one copy) loads on M ranks in either layout, optimizer
state included. The per-rank train state does not reshard: ``worker_states_for`` carries the counters over (all
ranks hold the same) and re-seeds the RNG (``resume_seed``); bitwise continuation needs the same world size.
docs/ARCHITECTURE.md ("Checkpoints and resume") has the table of what is restored in each case.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlpipe.errors import CheckpointError
from rlpipe.io import (
    atomic_write_json,
    fsync_dir,
    fsync_tree,
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
RNG_FORMAT = 1


# ----------------------------------------------------------------------------------------------- names and listing


def step_dir_name(step: int) -> str:
    """``step-000042``: zero-padded so lexical and numeric order agree up to a million steps."""
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    return f"step-{step:06d}"


def experiment_dir(root: str | os.PathLike[str], experiment: str | None = None) -> Path:
    """``<root>/<experiment>``, or ``root`` itself when ``experiment`` is None."""
    base = local_path(root)
    return base / experiment if experiment else base


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


class CheckpointWriter:
    """Context manager over begin/finalize/abort for a driver that writes a checkpoint in pieces.

    ::

        with CheckpointWriter(root, experiment, step) as w:
            workers.save(str(w.weights_dir))          # collective DCP save on the ranks
            w.write_train_state(TrainState(...)); w.write_config(cfg)
            path = w.finalize(manifest)
    Leaving the block without ``finalize`` (an exception, or forgetting it) deletes the temp dir.
    """

    def __init__(
        self, root: str | os.PathLike[str], experiment: str, step: int, exists: Literal["error", "replace"] = "error"
    ):
        self.root, self.experiment, self.step, self.exists = root, experiment, step, exists
        self.tmp_dir: Path | None = None
        self.final: Path | None = None

    def __enter__(self) -> CheckpointWriter:
        self.tmp_dir = begin_checkpoint(self.root, self.experiment, self.step)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.final is None and self.tmp_dir is not None:
            abort_checkpoint(self.tmp_dir)

    def _tmp(self) -> Path:
        if self.tmp_dir is None or self.final is not None:
            raise CheckpointError("CheckpointWriter is not open (use it as a context manager, before finalize)")
        return self.tmp_dir

    @property
    def weights_dir(self) -> Path:
        """Where the ranks' DCP shards go."""
        return self._tmp() / WEIGHTS_DIR

    @property
    def hf_dir(self) -> Path:
        """Where an optional safetensors export goes."""
        return self._tmp() / HF_DIR

    def write_train_state(self, state: TrainState) -> Path:
        return write_train_state(self._tmp(), state)

    def write_config(self, config: Any) -> Path:
        return write_config(self._tmp(), config)

    def finalize(self, manifest: Manifest) -> Path:
        """Publish the checkpoint (see ``finalize_checkpoint``) and return its final path."""
        self.final = finalize_checkpoint(self._tmp(), manifest, exists=self.exists)
        return self.final


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
    required: tuple[str, ...] = REQUIRED_FILES,
) -> Manifest:
    """Check a checkpoint before use and return its manifest; any problem is a CheckpointError naming it.

    Checks: manifest present, valid and ``complete``; step matches a ``step-NNNNNN`` dir name; the ``required`` files
    are listed; every listed file exists with its sha256; no unlisted file under ``weights/``; and, if given,
    ``expect_model_fingerprint`` equals the manifest's base model fingerprint (``lineage.model_fingerprint``).
    ``expect_architecture`` (``lineage.model_architecture`` of this run's model) lets that error name the fields
    that differ.
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
    return manifest


# ---------------------------------------------------------------------------------------------------- train state


class TrainState(BaseModel):
    """Contents of ``train_state.json``: everything besides weights needed to resume bit-for-bit."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="Optimizer steps taken.")
    iteration: int = Field(ge=0, description="RL iterations completed.")
    epoch: int = Field(default=0, ge=0, description="Prompt-data epoch.")
    consumed_samples: int = Field(default=0, ge=0, description="Prompts (or sequences) consumed so far.")
    consumed_tokens: int = Field(default=0, ge=0, description="Training tokens consumed so far.")
    sampler_state: dict[str, Any] | None = Field(default=None, description="PromptSampler.state_dict().")
    sft_loader_state: dict[str, Any] | None = Field(default=None, description="SFT loader sampler state_dict().")
    rng_states: list[dict[str, Any]] = Field(
        default_factory=list, description="capture_rng_state() per rank (index = rank), see gather_rng_states."
    )
    worker_states: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Per-rank JSON state returned by each training worker (counters, its RNG state), index = rank.",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Other JSON state (e.g. LR scheduler state).")


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


# ---------------------------------------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """JSON-safe RNG state of python ``random``, numpy's global RNG, torch CPU and (if available) CUDA.

    torch states are base64 of their uint8 tensor bytes; python/numpy states are their tuples as lists.
    """
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``; all parts are validated before any is set (no half-restored RNG).

    CUDA states are restored only when the device count matches (a GPU checkpoint resumed on CPU keeps going).
    """
    try:
        if state.get("format") != RNG_FORMAT:
            raise ValueError(f"unknown RNG state format {state.get('format')!r}")
        version, internal, gauss = state["python"]
        name, keys, pos, has_gauss, cached = state["numpy"]
        py_state = (int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss))
        np_state = (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
        torch_state = _unb64(state["torch"])
        cuda_states = [_unb64(s) for s in state.get("cuda", [])]
        if len(py_state[1]) != len(random.getstate()[1]):
            raise ValueError(f"python state has {len(py_state[1])} words, expected {len(random.getstate()[1])}")
        if np_state[0] != "MT19937" or np_state[1].shape != (624,) or not 0 <= np_state[2] <= 624:
            raise ValueError("numpy state is not a 624-word MT19937 state")
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"torch state has {torch_state.numel()} bytes, expected {torch.get_rng_state().numel()}")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CheckpointError(f"invalid RNG state: {e}") from None
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if cuda_states and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_rng_states() -> list[dict[str, Any]]:
    """Collective: every rank's ``capture_rng_state()``, indexed by rank (just ``[own]`` without a process group)."""
    rank, world = _dist_info()
    own = capture_rng_state()
    if world == 1:
        return [own]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, own)
    return out


def restore_rank_rng(state: TrainState, rank: int | None = None) -> bool:
    """Restore this rank's saved RNG state; False (state untouched) if none was saved for it (e.g. world size grew)."""
    rank = _dist_info()[0] if rank is None else rank
    if rank >= len(state.rng_states):
        return False
    restore_rng_state(state.rng_states[rank])
    return True


WORKER_COUNTERS = ("optimizer_step", "skipped_steps")
"""Per-rank worker state that every rank holds identically (one optimizer, stepped in lockstep)."""


def worker_states_for(saved: list[dict[str, Any]], world_size: int, where: str = "checkpoint") -> list[dict[str, Any]]:
    """The state each of ``world_size`` ranks resumes with, from the per-rank ``worker_states`` a checkpoint saved.

    Same world size: each rank gets its own saved state back, RNG included (bitwise continuation). Another world
    size: every rank gets the counters (checked equal over the saved ranks) and ``"rng": None``, which tells the
    worker to re-seed with ``resume_seed`` instead of taking over another rank's stream; rank r of 2 is not rank r
    of 1, so no mapping of RNG streams between world sizes would make the run bitwise equal anyway.
    """
    if not saved:
        raise CheckpointError(f"{where}: train_state.json has no worker_states (not written by a training run?)")
    for rank, state in enumerate(saved):
        missing = [k for k in (*WORKER_COUNTERS, "rng") if k not in state]
        if missing:
            raise CheckpointError(f"{where}: worker_states[{rank}] lacks {', '.join(missing)}")
    if len(saved) == world_size:
        return saved
    counters = {k: saved[0][k] for k in WORKER_COUNTERS}
    for rank, state in enumerate(saved[1:], start=1):
        for k in WORKER_COUNTERS:
            if state[k] != counters[k]:
                raise CheckpointError(
                    f"{where}: worker_states disagree on {k} (rank 0: {counters[k]}, rank {rank}: {state[k]}); "
                    "cannot resume on another world size"
                )
    return [{**counters, "rng": None} for _ in range(world_size)]


def resume_seed(seed: int, rank: int, optimizer_step: int) -> int:
    """Seed of rank ``rank``'s RNGs after a resume on another world size: a function of where the run is, so a
    resumed run is reproducible and does not replay the stream it started with (``seed + rank``, from setup)."""
    words = np.random.SeedSequence([seed % 2**63, rank, optimizer_step]).generate_state(2, dtype=np.uint32)
    return int(words[0]) | int(words[1]) << 32


# ----------------------------------------------------------------------------------------------------- DCP weights


@contextlib.contextmanager
def _quiet_single_process():
    """Silence DCP's "assuming the intent is to save in a single process" warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        yield


def _sd_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (DTensor) state: each rank saves/loads only its shard; DCP reshards on load if the world size changed.
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def save_dcp(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, weights_dir: str | os.PathLike[str]
) -> None:
    """Collective: save ``{"model", "optim"}`` with DCP. Works for plain modules and FSDP2 ``fully_shard`` models."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out = local_path(weights_dir)
    out.mkdir(parents=True, exist_ok=True)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=_sd_options())}
    else:
        msd, osd = get_state_dict(model, optimizer, options=_sd_options())
        state = {"model": msd, "optim": osd}
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(out), no_dist=not dist.is_initialized())


def check_dcp_matches(
    model_state: dict[str, torch.Tensor], weights_dir: str | os.PathLike[str], with_optimizer: bool = False
) -> None:
    """Raise a CheckpointError naming the file and the tensor when the DCP checkpoint does not fit ``model_state``.

    Compares global shapes from ``weights/.metadata`` with ``model_state`` (a DTensor's ``shape`` is global, so the
    check is the same for sharded and replicated policies and any world size). Without it a mismatch surfaces as
    DCP's per-rank traceback deep inside ``dcp.load``.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src = local_path(weights_dir)
    meta_file = src / ".metadata"
    try:
        saved = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: say which
        raise CheckpointError(f"cannot read DCP metadata {meta_file}: {e}") from e
    for name, tensor in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{meta_file}: the checkpoint has no weight {name!r} that this model has (a different architecture?)"
            )
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{meta_file}: weight {name!r} has shape {list(entry.size)} in the checkpoint but "
                f"{list(tensor.shape)} in this model (a different model shape)"
            )
    if with_optimizer and not any(k.startswith("optim.state.") for k in saved):
        raise CheckpointError(
            f"{meta_file}: the checkpoint holds no optimizer state (written with checkpoint.save_optimizer=false); "
            "resume with checkpoint.save_optimizer=false, or start a new stage from its weights (checkpoint.init_from)"
        )


def load_dcp(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, weights_dir: str | os.PathLike[str]
) -> None:
    """Collective: load DCP weights (and optimizer state unless ``optimizer`` is None) into ``model`` in place.

    The checkpoint may come from another world size and another layout (sharded DTensors <-> replicated tensors):
    DCP stores every tensor with its global shape and reads each rank's part back (see the module docstring).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    src = local_path(weights_dir)
    if not (src / ".metadata").is_file():
        raise CheckpointError(f"no DCP weights at {src} (missing .metadata)")
    opts = _sd_options()
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        state = {"model": msd, "optim": osd}
    check_dcp_matches(state["model"], src, with_optimizer=optimizer is not None)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(src), no_dist=not dist.is_initialized())
    except Exception as e:  # DCP wraps per-rank failures in CheckpointException; keep the cause
        raise CheckpointError(f"loading DCP weights from {src} failed: {e}") from e
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)


# ------------------------------------------------------------------------------------------ collective one-liners


def _broadcast(obj: Any) -> Any:
    """rank 0's ``obj`` on every rank (identity without a process group)."""
    if _dist_info()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(
    root: str | os.PathLike[str],
    manifest: Manifest,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train_state: TrainState,
    config: Any = None,
    exists: Literal["error", "replace"] = "error",
    export_fn: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: write and publish ``<root>/<manifest.experiment>/step-<manifest.step>``; returns its path.

    Every rank calls it with the same arguments (only rank 0's manifest/state/config are written). RNG states of
    all ranks are gathered into ``train_state.rng_states``. ``export_fn(tmp_dir)``, if given, runs on every rank
    after the weights are saved (e.g. a collective HF export into ``tmp_dir / "hf"``). Any failure removes the temp
    dir and raises CheckpointError on every rank.
    """
    rank, _ = _dist_info()
    tmp = begin_checkpoint(root, manifest.experiment, manifest.step) if rank == 0 else None
    tmp = Path(_broadcast(None if tmp is None else str(tmp)))
    try:
        rng = gather_rng_states()
        save_dcp(model, optimizer, tmp / WEIGHTS_DIR)
        if export_fn is not None:
            export_fn(tmp)
    except BaseException:
        if rank == 0:
            abort_checkpoint(tmp)
        raise
    result: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            write_train_state(tmp, train_state.model_copy(update={"rng_states": rng}))
            if config is not None:
                write_config(tmp, config)
            result = (str(finalize_checkpoint(tmp, manifest, exists=exists)), None)
        except Exception as e:
            abort_checkpoint(tmp)
            result = (None, f"{type(e).__name__}: {e}")
    final, error = _broadcast(result)
    if error is not None:
        raise CheckpointError(f"saving checkpoint step {manifest.step} failed: {error}")
    return Path(final)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    expect_model_fingerprint: str | None = None,
    verify: bool = True,
    restore_rng: bool = True,
) -> TrainState:
    """Collective: (rank 0 verifies,) load weights + optimizer, restore this rank's RNG; returns the TrainState."""
    rank, _ = _dist_info()
    error = None
    if verify and rank == 0:
        try:
            verify_checkpoint(path, expect_model_fingerprint)
        except CheckpointError as e:
            error = str(e)
    error = _broadcast(error)
    if error is not None:
        raise CheckpointError(error)
    load_dcp(model, optimizer, local_path(path) / WEIGHTS_DIR)
    state = load_train_state(path)
    if restore_rng:
        restore_rank_rng(state, rank)
    return state
