"""The GPU weight-sync path: the policy streamed to a vLLM server over NCCL, in buckets, with no disk round trip.

vLLM 0.32's weight-transfer routes (server started with `--weight-transfer-config '{"backend": "nccl"}'` and
`VLLM_SERVER_DEV_MODE=1`):

1. once: `POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset: 1,
   world_size, packed: false}}` while the trainer's rank 0 joins the same NCCL group as rank 0 (both block in the
   rendezvous, so the POST runs on a side thread);
2. per sync: `POST /pause?mode=wait`, `POST /start_weight_update`, then per bucket `POST /update_weights
   {"update_info": {names, dtype_names, shapes}}` concurrently with one `broadcast(src=0)` per tensor of the bucket
   in that order (the server receives exactly what the update info announces), `POST /finish_weight_update
   {"weight_version": "v"}`, `POST /reset_prefix_cache`, and `POST /resume` in `finally`.

Buckets bound the trainer's extra memory: under FSDP2 every rank gathers only one bucket of full tensors at a time
(`full_tensor()` is a collective), rank 0 broadcasts it and frees it. The communicator is vLLM's own
(`open_trainer_endpoint`), so the trainer image needs vllm installed; everything else here is plain HTTP and is unit
tested with a fake communicator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlpipe.errors import ConfigError, WeightSyncError
from rlpipe.rollout.http_json import request_json


@dataclass(frozen=True)
class TensorMeta:
    """What the server must allocate to receive one tensor."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(
            name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.numel() * tensor.element_size()
        )


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Split tensors, in order, into consecutive buckets of at most `bucket_bytes` (a bigger tensor goes alone)."""
    if bucket_bytes < 1:
        raise ConfigError(f"weight transfer bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        if current and size + meta.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def update_info(bucket: list[TensorMeta]) -> dict[str, Any]:
    """The `update_info` body of `/update_weights` for one bucket."""
    return {
        "names": [m.name for m in bucket],
        "dtype_names": [m.dtype for m in bucket],
        "shapes": [list(m.shape) for m in bucket],
    }


def init_info(master_address: str, master_port: int, inference_world_size: int) -> dict[str, Any]:
    """The `init_info` body of `/init_weight_transfer_engine`: trainer rank 0 + the server's workers after it."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": 1,
        "world_size": 1 + int(inference_world_size),
        "packed": False,
    }


class Broadcaster(Protocol):
    """A communicator whose rank 0 is the trainer (vLLM's PyNcclCommunicator; a fake in tests)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...


class NCCLWeightSender:
    """Trainer rank 0's side of the transfer: HTTP control calls to the server, tensors through `broadcaster`."""

    def __init__(self, base_url: str, broadcaster: Broadcaster, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.broadcaster = broadcaster
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        return request_json(self.base_url + route, body or {}, self.timeout_s)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> int:
        """Stream every bucket (name, full tensor) and publish `version`; returns the number of tensors sent."""
        sent = 0
        self._post("/pause?mode=wait")
        try:
            self._post("/start_weight_update")
            for bucket in buckets:
                sent += self._send_bucket(bucket)
            self._post("/finish_weight_update", {"weight_version": str(version)})
            self._post("/reset_prefix_cache")
        finally:
            self._post("/resume")
        return sent

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        info = update_info([TensorMeta.of(name, t) for name, t in bucket])
        with ThreadPoolExecutor(max_workers=1) as pool:
            # The server blocks in its receive until the broadcasts arrive: the POST runs beside them.
            answer = pool.submit(self._post, "/update_weights", {"update_info": info})
            for _name, tensor in bucket:
                if answer.done():
                    answer.result()  # a rejected request would leave the broadcast waiting forever
                self.broadcaster.broadcast(tensor.contiguous(), src=0)
            try:
                answer.result(timeout=self.timeout_s)
            except TimeoutError as e:
                raise WeightSyncError(f"{self.base_url}/update_weights did not return after the broadcast") from e
        return len(bucket)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    materialize: Callable[[torch.Tensor], torch.Tensor],
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, parameter) pairs into buckets of full tensors, materialising each one only when its bucket is
    sent (`materialize`: `DTensor.full_tensor` under FSDP2, a collective every rank runs in the same order)."""
    pairs = list(named_tensors)
    metas = [TensorMeta.of(n, t) for n, t in pairs]
    index = {name: t for name, t in pairs}
    for bucket in plan_buckets(metas, bucket_bytes):
        yield [(m.name, materialize(index[m.name])) for m in bucket]


def open_vllm_communicator(master_address: str, master_port: int, world_size: int) -> Broadcaster:
    """Trainer rank 0's end of vLLM's NCCL group (needs vllm importable in the trainer's environment and a GPU)."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError as e:
        raise ConfigError(
            "rollout.weight_sync.method=nccl needs vllm installed in the trainer's image (its NCCL communicator); "
            "use method=disk otherwise"
        ) from e
    if not torch.cuda.is_available():
        raise ConfigError("rollout.weight_sync.method=nccl needs a CUDA device on the trainer; use method=disk")
    device = torch.device("cuda", torch.cuda.current_device())
    return stateless_init_process_group(master_address, master_port, rank=0, world_size=world_size, device=device)
