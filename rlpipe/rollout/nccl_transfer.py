"""The GPU weight-sync path: the policy streamed to one or several vLLM servers over NCCL, in buckets, with no disk
round trip.

vLLM 0.32's weight-transfer routes (server started with `--weight-transfer-config '{"backend": "nccl"}'` and
`VLLM_SERVER_DEV_MODE=1`):

1. once: `POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
   packed: false}}` to every server while the trainer's rank 0 joins the same NCCL group as rank 0 (all block in the
   rendezvous, so the POSTs run on side threads). One group holds every replica: the trainer is rank 0 and replica i's
   workers follow from `rank_offset` = 1 + the world sizes of the replicas before it (`group_layout`);
2. per sync, on every server at once: `POST /pause?mode=wait`, `POST /start_weight_update`, then per bucket
   `POST /update_weights {"update_info": {names, dtype_names, shapes}}` to all of them concurrently with one
   `broadcast(src=0)` per tensor of the bucket in that order (each tensor crosses the trainer's link once, whatever
   the number of replicas; every server receives exactly what the update info announces), `POST
   /finish_weight_update {"weight_version": "v"}`, `POST /reset_prefix_cache`, and `POST /resume` in `finally`.

A server is reached through a `ControlEndpoint`: plain HTTP for a server at a URL (`HttpControl`), or the replica's
own Ray actor for a managed replica that listens on its node's loopback only (`rlpipe.rollout.replica_actor`).

Buckets bound the trainer's extra memory: under FSDP2 every rank gathers only one bucket of full tensors at a time
(`full_tensor()` is a collective), rank 0 broadcasts it and frees it. The communicator is vLLM's own
(`stateless_init_process_group`, through `open_vllm_communicator`), so the trainer image needs vllm installed;
everything else here is plain HTTP and is unit tested with a fake communicator, and with real gloo broadcasts to
fake servers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
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


def init_info(master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
    """The `init_info` body of `/init_weight_transfer_engine` for one server whose workers start at `rank_offset`."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "packed": False,
    }


def group_layout(inference_world_sizes: list[int]) -> tuple[list[int], int]:
    """(rank offset of each server, world size of the group): the trainer is rank 0, the servers' workers follow."""
    if not inference_world_sizes or any(w < 1 for w in inference_world_sizes):
        raise ConfigError(f"NCCL weight transfer needs servers of >= 1 worker each, got {inference_world_sizes}")
    offsets, next_rank = [], 1
    for size in inference_world_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


class Broadcaster(Protocol):
    """A communicator whose rank 0 is the trainer (vLLM's PyNcclCommunicator; a fake in tests)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...


class ControlEndpoint(Protocol):
    """How the trainer reaches one server's admin routes (picklable: it travels to trainer rank 0)."""

    name: str

    def call(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any: ...


class HttpControl:
    """A server the trainer reaches at `base_url`."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.name = self.base_url

    def call(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        return request_json(self.base_url + route, body if body is not None or method == "GET" else {},
                            self.timeout_s, method=method)  # fmt: skip


def on_every_server(endpoints: list[ControlEndpoint], route: str, body: dict[str, Any] | None = None,
                    method: str = "POST") -> list[Any]:  # fmt: skip
    """`route` on every server at once; the answers in order, or the first failure (after all of them returned)."""
    if len(endpoints) == 1:
        return [endpoints[0].call(route, body, method)]
    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        futures = [pool.submit(e.call, route, body, method) for e in endpoints]
        errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc
    return [f.result() for f in futures]


def server_world_sizes(endpoints: list[ControlEndpoint]) -> list[int]:
    """Each server's number of workers in the group (its tensor x pipeline x data parallel size)."""
    return [int(answer["world_size"]) for answer in on_every_server(endpoints, "/get_world_size", None, "GET")]


def join_weight_transfer(endpoints: list[ControlEndpoint], master_address: str, master_port: int,
                         open_communicator: Callable[[str, int, int], Broadcaster]) -> Broadcaster:  # fmt: skip
    """Trainer rank 0 and every server's workers join one group (`group_layout`); returns rank 0's communicator.
    If rank 0 cannot join (no CUDA, no vllm), the error is raised at once: the servers' calls, stuck in the
    rendezvous, are left to their own timeouts."""
    offsets, world = group_layout(server_world_sizes(endpoints))
    pool = ThreadPoolExecutor(max_workers=len(endpoints))  # every side blocks in the rendezvous
    try:
        answers = [
            pool.submit(e.call, "/init_weight_transfer_engine", {"init_info": init_info(master_address, master_port,
                                                                                        off, world)})
            for e, off in zip(endpoints, offsets, strict=True)
        ]  # fmt: skip
        communicator = open_communicator(master_address, master_port, world)
        for answer in answers:
            answer.result()
    finally:
        pool.shutdown(wait=False)
    return communicator


class NCCLWeightSender:
    """Trainer rank 0's side of the transfer: control calls to every server, each tensor broadcast once to all."""

    def __init__(self, endpoints: list[ControlEndpoint], broadcaster: Broadcaster, timeout_s: float = 600.0,
                 resume_grace_s: float = 30.0):  # fmt: skip
        if not endpoints:
            raise ConfigError("NCCL weight transfer needs at least one server")
        self.endpoints = list(endpoints)
        self.broadcaster = broadcaster
        self.timeout_s = timeout_s
        self.resume_grace_s = resume_grace_s  # after a failed transfer: how long the error waits for the resumes

    def _all(self, route: str, body: dict[str, Any] | None = None) -> list[Any]:
        return on_every_server(self.endpoints, route, body)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> int:
        """Stream every bucket (name, full tensor) and publish `version` on every server; returns the number of
        tensors sent (each broadcast once, whatever the number of servers)."""
        sent = 0
        try:
            self._all("/pause?mode=wait")  # inside: servers that paused are resumed when another one fails to
            self._all("/start_weight_update")
            for bucket in buckets:
                sent += self._send_bucket(bucket)
            self._all("/finish_weight_update", {"weight_version": str(version)})
            self._all("/reset_prefix_cache")
        except BaseException:
            self._resume_after_failure()
            raise
        self._resume_all()
        return sent

    def _resume_all(self) -> None:
        """Resume every server at once, each whatever the others answer (`on_every_server` waits for all of them
        before it raises the first failure)."""
        on_every_server(self.endpoints, "/resume", {})

    def _resume_after_failure(self) -> None:
        """Ask every server to resume, waiting at most `resume_grace_s` before the transfer's error goes on: a
        server still blocked in a receive (another one rejected the bucket) answers only at its HTTP timeout, and
        the run stops anyway, since a group broken mid-transfer cannot be used again."""
        threads = [threading.Thread(target=_call_quietly, args=(e, "/resume"), daemon=True) for e in self.endpoints]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.resume_grace_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        info = update_info([TensorMeta.of(name, t) for name, t in bucket])
        pool = ThreadPoolExecutor(max_workers=len(self.endpoints))
        answers = []
        try:
            # Every server blocks in its receive until the broadcasts arrive: the POSTs run beside them.
            answers = [pool.submit(e.call, "/update_weights", {"update_info": info}) for e in self.endpoints]
            for _name, tensor in bucket:
                for answer in answers:
                    if answer.done():
                        answer.result()  # a rejected request would leave the broadcast waiting forever
                self.broadcaster.broadcast(tensor.contiguous(), src=0)
            # A rejection is raised as soon as it arrives, even while another server still waits in its receive.
            done, _ = wait(answers, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
            for answer in answers:
                if answer in done:
                    answer.result()
            for endpoint, answer in zip(self.endpoints, answers, strict=True):
                if answer not in done:
                    raise WeightSyncError(f"{endpoint.name}: /update_weights did not return after the broadcast")
        except BaseException:
            wait(answers, timeout=self.resume_grace_s)  # the others' requests land before they are told to resume
            raise
        finally:
            pool.shutdown(wait=False)  # after a rejection the other servers may still wait for broadcasts
        return len(bucket)


def _call_quietly(endpoint: ControlEndpoint, route: str) -> None:
    """One control call whose failure is not the error to report (the transfer's own error is)."""
    try:
        endpoint.call(route, {})
    except Exception:  # noqa: BLE001
        pass


def send_or_drain(sender: NCCLWeightSender, buckets: Iterator[list[tuple[str, torch.Tensor]]], version: int) -> int:
    """Rank 0's send. If it fails, the rest of `buckets` is still materialised (under FSDP2 each bucket is a gather
    every rank joins), so the other ranks finish their gathers and only this sync fails, instead of every other
    rank hanging in its next one."""
    try:
        return sender.send(buckets, version)
    except BaseException:
        try:
            for _ in buckets:
                pass
        except Exception:  # noqa: BLE001 (the send's own error is the one to report)
            pass
        raise


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
