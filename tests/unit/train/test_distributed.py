"""Reductions over ranks, on a real 2-process gloo group (spawned here, no Ray)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _grads_of(rank: int) -> list[torch.nn.Parameter]:
    """Parameters of mixed shapes and dtypes whose grads differ per rank; one without a grad."""
    shapes = [(3, 4), (5,), (2, 2, 2), (7,), (1,)]
    params = []
    for i, shape in enumerate(shapes):
        dtype = torch.float64 if i == 3 else torch.float32
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.arange(p.numel(), dtype=dtype).reshape(shape) * (rank + 1) + i
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # grad None: skipped
    return params


def _rank_main(rank: int, store_path: str, bucket_bytes: int, out_path: str) -> None:
    from rlpipe.train.distributed import all_reduce_grads

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        params = _grads_of(rank)
        all_reduce_grads(params, bucket_bytes=bucket_bytes)
        if rank == 0:
            torch.save([p.grad for p in params], out_path)
    finally:
        dist.destroy_process_group()


def test_all_reduce_grads_sums_every_grad_over_ranks_in_buckets(tmp_path):
    """Tiny buckets (a few parameters each) and one float64 grad among float32 ones: every grad is the rank sum."""
    out = tmp_path / "grads.pt"
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), 48, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    expected = [a.grad + b.grad for a, b in zip(_grads_of(0)[:-1], _grads_of(1)[:-1], strict=True)]
    assert got[-1] is None
    for g, e in zip(got[:-1], expected, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_all_reduce_grads_is_a_noop_without_a_process_group():
    from rlpipe.train.distributed import all_reduce_grads

    params = _grads_of(0)
    before = [p.grad.clone() if p.grad is not None else None for p in params]
    all_reduce_grads(params)
    assert all((a is None and b.grad is None) or torch.equal(a, b.grad) for a, b in zip(before, params, strict=True))


def test_auto_layout_shards_only_policies_of_a_gib_or_more(monkeypatch):
    """`train.fsdp=auto` and `fsdp_reshard_after_forward=auto` both flip at `SMALL_MODEL_BYTES` of parameters."""
    from rlpipe.train import policy

    model = torch.nn.Linear(16, 16)  # 272 float32 parameters = 1088 bytes
    assert policy.parameter_bytes(model) == 1088
    assert policy.resolve_small_model_auto("auto", model) is False
    monkeypatch.setattr(policy, "SMALL_MODEL_BYTES", 1088)
    assert policy.resolve_small_model_auto("auto", model) is True
    assert policy.resolve_small_model_auto(False, model) is False and policy.resolve_small_model_auto(True, model)
