"""The NCCL weight transfer without GPUs: what the sender asks each server, in which order, and that every server
receives every tensor. Loopback http.servers stand in for vLLM (`tests.fake_http.Recorder`); the communicator is a
recorder, or a real gloo group with the same rank layout as vLLM's (trainer rank 0, each server's workers from its
rank offset), so one broadcast per tensor reaching every replica is checked with real collectives."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rlpipe.errors import ConfigError, RolloutServerError
from rlpipe.rollout.nccl_transfer import (
    HttpControl,
    NCCLWeightSender,
    TensorMeta,
    group_layout,
    init_info,
    iter_buckets,
    join_weight_transfer,
    plan_buckets,
    send_or_drain,
)
from rlpipe.train.distributed import free_port
from tests.fake_http import Recorder


@pytest.fixture
def servers():
    recs = [Recorder(), Recorder()]
    yield recs
    for rec in recs:
        rec.close()


class FakeBroadcaster:
    def __init__(self, events):
        self.events, self.sent = events, []

    def broadcast(self, tensor, src=0):
        assert src == 0 and tensor.is_contiguous()
        self.sent.append(tensor.clone())
        self.events.append(f"broadcast {tuple(tensor.shape)}")


def test_buckets_keep_order_and_bound_size():
    metas = [TensorMeta(f"w{i}", "float32", (n,), 4 * n) for i, n in enumerate([10, 10, 30, 5, 1])]
    buckets = plan_buckets(metas, bucket_bytes=80)
    assert [[m.name for m in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]  # w2 (120 B) goes alone
    assert [m for b in buckets for m in b] == metas
    with pytest.raises(ConfigError):
        plan_buckets(metas, 0)


def test_buckets_materialise_lazily_in_order():
    seen: list[str] = []
    pairs = [(f"p{i}", torch.full((4,), float(i))) for i in range(3)]

    def materialize(t):
        seen.append(f"gather {int(t[0])}")
        return t * 1

    it = iter_buckets(pairs, bucket_bytes=16, materialize=materialize)
    first = next(it)
    assert [n for n, _ in first] == ["p0"] and seen == ["gather 0"]  # nothing else gathered yet
    rest = list(it)
    assert [n for b in rest for n, _ in b] == ["p1", "p2"] and seen == ["gather 0", "gather 1", "gather 2"]


def test_group_layout_puts_each_servers_workers_after_the_previous_ones():
    assert group_layout([1]) == ([1], 2)
    assert group_layout([2, 1, 4]) == ([1, 3, 4], 8)  # trainer 0; server 0: 1-2; server 1: 3; server 2: 4-7
    with pytest.raises(ConfigError):
        group_layout([])
    assert init_info("10.0.0.1", 29500, 3, 8) == {"master_address": "10.0.0.1", "master_port": 29500,
                                                 "rank_offset": 3, "world_size": 8, "packed": False}  # fmt: skip


def test_sender_announces_each_bucket_to_every_server_and_broadcasts_each_tensor_once(servers):
    comm = FakeBroadcaster(servers[0].events)
    sender = NCCLWeightSender([HttpControl(s.url) for s in servers], comm)
    w = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous: must be sent contiguous
    buckets = [[("a", torch.ones(2)), ("b", w)], [("c", torch.zeros(1, dtype=torch.bfloat16))]]
    assert sender.send(iter(buckets), version=9) == 3
    assert len(comm.sent) == 3 and torch.equal(comm.sent[1], w)  # once, whatever the number of servers
    for server in servers:
        routes = server.paths()
        assert routes[:2] == ["/pause?mode=wait", "/start_weight_update"]
        assert routes[-3:] == ["/finish_weight_update", "/reset_prefix_cache", "/resume"]
        updates = [b for p, b in server.requests if p == "/update_weights"]
        assert updates == [
            {"update_info": {"names": ["a", "b"], "dtype_names": ["float32", "float32"], "shapes": [[2], [3, 2]]}},
            {"update_info": {"names": ["c"], "dtype_names": ["bfloat16"], "shapes": [[1]]}},
        ]
        assert server.requests[-3][1] == {"weight_version": "9"}


def test_one_server_rejecting_an_update_fails_the_sync_naming_it_and_every_server_resumes(servers):
    servers[1].fail.add("/update_weights")
    sender = NCCLWeightSender([HttpControl(s.url) for s in servers], FakeBroadcaster([]), timeout_s=5)
    with pytest.raises(RolloutServerError, match=f"{servers[1].url}/update_weights: HTTP 500"):
        sender.send(iter([[("a", torch.ones(2))], [("b", torch.ones(2))]]), version=1)
    for server in servers:
        assert server.paths()[-1] == "/resume" and "/finish_weight_update" not in server.paths()
    assert [p for p in servers[0].paths() if p == "/update_weights"] == ["/update_weights"]  # stopped at bucket 1


def test_a_rejection_is_raised_at_once_while_another_server_still_waits_in_its_receive(servers):
    """Server 0 blocks in /update_weights (waiting for broadcasts the failed transfer never sends) and so cannot
    answer /resume either; server 1 rejects the bucket. The error comes within the resume grace, not at the
    blocked server's HTTP timeout."""
    release = threading.Event()

    def blocked(_body):
        release.wait(30)
        return {}

    servers[0].handlers.update({"/update_weights": blocked, "/resume": blocked})
    servers[1].fail.add("/update_weights")
    sender = NCCLWeightSender([HttpControl(s.url) for s in servers], FakeBroadcaster([]), timeout_s=30,
                              resume_grace_s=0.5)  # fmt: skip
    start = time.monotonic()
    try:
        with pytest.raises(RolloutServerError, match=f"{servers[1].url}/update_weights: HTTP 500"):
            sender.send(iter([[("a", torch.ones(2))]]), version=1)
        assert time.monotonic() - start < 10
        assert servers[1].paths()[-1] == "/resume"  # the server that answered is resumed
    finally:
        release.set()


def test_a_server_that_cannot_pause_fails_the_sync_and_the_ones_that_paused_are_resumed(servers):
    servers[0].fail.add("/pause")
    sender = NCCLWeightSender([HttpControl(s.url) for s in servers], FakeBroadcaster([]), timeout_s=5)
    with pytest.raises(RolloutServerError, match=f"{servers[0].url}/pause"):
        sender.send(iter([[("a", torch.ones(2))]]), version=1)
    assert servers[1].paths() == ["/pause?mode=wait", "/resume"]  # paused, then resumed, nothing started
    assert servers[0].paths()[-1] == "/resume"


def test_a_failed_send_still_runs_every_remaining_gather_so_the_other_ranks_do_not_hang(servers):
    """Under FSDP2 each bucket is materialised by a gather all ranks join: rank 0 must finish them all even when
    a server rejects the first bucket, or every other rank waits forever in the next gather."""
    servers[1].fail.add("/update_weights")
    sender = NCCLWeightSender([HttpControl(s.url) for s in servers], FakeBroadcaster([]), timeout_s=5)
    gathered = []

    def gather(t):
        gathered.append(tuple(t.shape))
        return t

    params = [(f"p{i}", torch.ones(i + 1)) for i in range(4)]
    with pytest.raises(RolloutServerError, match="update_weights: HTTP 500"):
        send_or_drain(sender, iter_buckets(params, bucket_bytes=4, materialize=gather), version=1)
    assert gathered == [(1,), (2,), (3,), (4,)]  # all four, though the send stopped at the first bucket


class GlooRank:
    """One rank of a gloo group with vLLM's stateless layout (rank 0 hosts the store): a real `broadcast`."""

    def __init__(self, address: str, port: int, rank: int, world_size: int):
        timeout = timedelta(seconds=30)
        self.store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()


def _gloo_server(rec: Recorder, workers: int) -> dict[str, list[torch.Tensor]]:
    """Make `rec` answer the weight-transfer routes as a server of `workers` gloo ranks; returns, per worker rank,
    the tensors it received (what a vLLM worker would load)."""
    received: dict[str, list[torch.Tensor]] = {}
    ranks: list[GlooRank] = []

    def init(body):
        info = body["init_info"]
        assert info["packed"] is False
        own_ranks = range(info["rank_offset"], info["rank_offset"] + workers)

        def join(rank: int) -> GlooRank:
            return GlooRank(info["master_address"], info["master_port"], rank, info["world_size"])

        with ThreadPoolExecutor(workers) as pool:  # a server's workers join together
            ranks.extend(pool.map(join, own_ranks))
        return {}

    def update(body):
        info = body["update_info"]

        def receive(rank: GlooRank) -> None:
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                buf = torch.empty(shape, dtype=getattr(torch, dtype))
                rank.broadcast(buf, src=0)
                received.setdefault(name, []).append(buf)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(receive, ranks))
        return {}

    rec.handlers.update({"/get_world_size": lambda _b: {"world_size": workers},
                         "/init_weight_transfer_engine": init, "/update_weights": update})  # fmt: skip
    return received


def test_a_real_gloo_broadcast_reaches_every_worker_of_every_server_through_the_rank_layout(servers):
    received = [_gloo_server(servers[0], workers=2), _gloo_server(servers[1], workers=1)]
    endpoints = [HttpControl(s.url, timeout_s=60) for s in servers]
    opened: list[int] = []

    def open_communicator(address, port, world_size):
        opened.append(world_size)
        return GlooRank(address, port, 0, world_size)

    comm = join_weight_transfer(endpoints, "127.0.0.1", free_port(), open_communicator)
    assert opened == [4]  # trainer + 2 + 1
    inits = [[b for p, b in s.requests if p == "/init_weight_transfer_engine"][0]["init_info"] for s in servers]
    assert [(i["rank_offset"], i["world_size"]) for i in inits] == [(1, 4), (3, 4)]
    g = torch.Generator().manual_seed(0)
    weights = {"embed": torch.randn(5, 3, generator=g), "norm": torch.randn(3, generator=g).to(torch.bfloat16),
               "head": torch.randn(3, 5, generator=g).t()}  # fmt: skip
    sender = NCCLWeightSender(endpoints, comm, timeout_s=60)
    sent = sender.send(iter_buckets(weights.items(), bucket_bytes=64, materialize=lambda t: t), version=2)
    assert sent == 3
    for server_received, workers in zip(received, (2, 1), strict=True):
        assert sorted(server_received) == sorted(weights)
        for name, tensor in weights.items():
            copies = server_received[name]
            assert len(copies) == workers and all(torch.equal(c, tensor) and c.dtype == tensor.dtype for c in copies)
