"""Process-group plumbing for the training workers: device choice, rendezvous, reductions."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(requested: str) -> torch.device:
    """`auto` -> the local CUDA device when one is visible, else CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from rlpipe.errors import ConfigError

            raise ConfigError("train.device=cuda but no CUDA device is visible to this worker")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """nccl on GPU, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def data_mesh(device: torch.device, world_size: int, sp_size: int = 1):
    """The (dp, sp) mesh: rank = dp_rank * sp_size + sp_rank, so an sp group is `sp_size` consecutive ranks (what
    `rlpipe.data.packing.mesh_shards` assumes). sp_size 1: the 1-D dp mesh, every rank one dp rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if sp_size == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device.type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))


def fsdp_mesh(mesh):
    """The mesh FSDP2 shards over: every rank (dp x sp, flattened), since the sp ranks of a group hold partial
    gradients of the same packs and the reduction must span them as well as the dp ranks."""
    if mesh.mesh_dim_names == ("dp",):
        return mesh
    return mesh["dp", "sp"]._flatten("dp_sp")


def free_port() -> int:
    """An ephemeral TCP port that is free right now on this host (rank 0 hosts the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, backend: str) -> None:
    """Join the job's process group (idempotent per process)."""
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )


_DATA_GROUP = None
"""The group data statistics are reduced over (`set_data_group`); None: every rank."""


def set_data_group(group) -> None:
    """Make `all_reduce_sum` / `all_reduce_min_max` reduce over `group`: the dp ranks holding one sp rank each.

    Why: with `train.sp_size` > 1 the sp ranks of a group train the same packs and hold the same full-pack
    logprobs (`rlpipe.models.sequence_parallel`), so their token counts, losses and metrics must be counted once;
    gradients are still summed over every rank (`all_reduce_grads`)."""
    global _DATA_GROUP
    _DATA_GROUP = group


def _data_group_size() -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(_DATA_GROUP)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over the data ranks (`set_data_group`; in place, returned for chaining)."""
    if _data_group_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=_DATA_GROUP)
    return values


def all_reduce_min_max(mins: torch.Tensor, maxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max over the data ranks, in place, in one collective (min x = -max(-x)).

    Why one: on CPU a gloo collective costs ~0.3 ms at the median and several ms at the tail (scheduling), and a
    training step issues a dozen; merging the metric reductions is measurable for small models.
    """
    if _data_group_size() > 1 and mins.numel() + maxs.numel() > 0:
        both = torch.cat([-mins.reshape(-1), maxs.reshape(-1)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_DATA_GROUP)
        mins.copy_(-both[: mins.numel()].reshape(mins.shape))
        maxs.copy_(both[mins.numel() :].reshape(maxs.shape))
    return mins, maxs


GRAD_BUCKET_BYTES = 25 * 2**20
"""Gradients are summed over ranks in flat buckets of about this size (as DDP does): one collective per bucket
instead of one per parameter, with at most one bucket of extra memory."""


def all_reduce_grads(params: Iterable[torch.nn.Parameter], bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum the `.grad` of replicated (unsharded) parameters over ranks, in place, bucket by bucket."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in (p.grad for p in params if p.grad is not None):
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            _all_reduce_flat(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_flat(bucket)


def _all_reduce_flat(grads: list[torch.Tensor]) -> None:
    """One SUM all-reduce over the concatenation of same-device grads (grouped by dtype), copied back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
