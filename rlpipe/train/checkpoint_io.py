"""What the training ranks write into and read from a checkpoint: DCP weights and optimizer, RNG states, and the
per-rank state remapped when the world size changes.

Another world size: DCP records every tensor with its global shape, so a checkpoint written by N ranks (FSDP2
DTensor shards, or replicated plain tensors deduplicated to one copy) loads on M ranks in either layout, optimizer
state included. The per-rank train state does not reshard: ``worker_states_for`` carries the counters over (all
ranks hold the same) and re-seeds the RNG (``resume_seed``); bitwise continuation needs the same world size.
docs/ARCHITECTURE.md ("Checkpoints and resume") has the table of what is restored in each case. The directory
layout, atomic publish and verification are ``rlpipe.train.checkpoint``'s.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlpipe.errors import CheckpointError
from rlpipe.io import local_path

RNG_FORMAT = 1


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


KeyFilter = Callable[[str], bool] | None
"""Which model weights a checkpoint holds (None: all). LoRA runs keep only the adapters (``is_adapter_param``): the
frozen base weights are the base model's files, guarded by its weights hash in the lineage manifest."""


def _model_and_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, keys: KeyFilter) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=_sd_options())}
    else:
        msd, osd = get_state_dict(model, optimizer, options=_sd_options())
        state = {"model": msd, "optim": osd}
    if keys is not None:
        state["model"] = {name: t for name, t in state["model"].items() if keys(name)}
    return state


def save_dcp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights_dir: str | os.PathLike[str],
    keys: KeyFilter = None,
) -> None:
    """Collective: save ``{"model", "optim"}`` with DCP. Works for plain modules and FSDP2 ``fully_shard`` models;
    ``keys`` selects the weights saved (``KeyFilter``; the optimizer state is whatever the optimizer holds)."""
    import torch.distributed.checkpoint as dcp

    out = local_path(weights_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = _model_and_optim_state(model, optimizer, keys)
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


def check_dcp_visible(weights_dir: str | os.PathLike[str]) -> None:
    """Raise a CheckpointError unless this process (the driver) sees every file the ranks' DCP save needs.

    Why: the driver hashes a checkpoint's files into its manifest and publishes it, but each rank writes its shard
    on its own node. With a `checkpoint.root` that is not storage shared by the driver and every trainer node, the
    driver would publish a checkpoint without those shards, found out only at the next resume.
    """
    from torch.distributed.checkpoint import FileSystemReader

    src = local_path(weights_dir)
    hint = (
        "the trainer ranks wrote files this driver cannot see: checkpoint.root must be storage that the driver and "
        "every trainer node share (a ReadWriteMany volume, k8s/base/pvc.yaml)"
    )
    if not (src / ".metadata").is_file():
        raise CheckpointError(f"no DCP weights at {src} after the ranks saved them (missing .metadata): {hint}")
    needed = {info.relative_path for info in FileSystemReader(str(src)).read_metadata().storage_data.values()}
    missing = sorted(name for name in needed if not (src / name).is_file())
    if missing:
        raise CheckpointError(f"DCP weights at {src} lack {missing} named by its .metadata: {hint}")


def load_dcp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights_dir: str | os.PathLike[str],
    keys: KeyFilter = None,
) -> None:
    """Collective: load DCP weights (and optimizer state unless ``optimizer`` is None) into ``model`` in place.

    The checkpoint may come from another world size and another layout (sharded DTensors <-> replicated tensors):
    DCP stores every tensor with its global shape and reads each rank's part back (see the module docstring).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    src = local_path(weights_dir)
    if not (src / ".metadata").is_file():
        raise CheckpointError(f"no DCP weights at {src} (missing .metadata)")
    state = _model_and_optim_state(model, optimizer, keys)
    # a partial model state (``keys``) must not make set_state_dict demand the weights it left out
    opts = _sd_options() if keys is None else StateDictOptions(full_state_dict=False, cpu_offload=False, strict=False)
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
