"""DCP checkpoints move between world sizes and layouts: 1 rank replicated <-> 2 ranks FSDP2-sharded, weights and
AdamW state (exp_avg, exp_avg_sq, step) exactly; worker counters/RNG mapping; model-shape mismatches named.

The 2-rank half runs in a real 2-process gloo group spawned here (no Ray). The model is a small policy-shaped module
(embedding, decoder-like blocks each its own FSDP2 unit, LM head tied to the embedding) rather than the HF tiny
model, so the spawned ranks need not import transformers (~10 s each on a loaded 2-core box). The HF policy through
real workers, with samplers, counters and the LR schedule, is tests/integration/test_resume_world_size.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlpipe.errors import CheckpointError
from rlpipe.train import checkpoint_io as cio

VOCAB = 40


class _Policy(nn.Module):
    """Token embedding, `layers` residual MLP blocks, final norm, LM head tied to the embedding."""

    def __init__(self, seed: int, hidden: int = 16, layers: int = 2):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, hidden)
            self.layers = nn.ModuleList(
                nn.Sequential(
                    nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
                )
                for _ in range(layers)
            )
            self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return torch.log_softmax(self.head(self.norm(h)).float(), dim=-1)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)  # as build_optimizer


def _train(policy: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """A few next-token AdamW steps, so every weight, exp_avg and exp_avg_sq is non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
        logprobs = policy(ids[:, :-1])
        (-logprobs.gather(-1, ids[:, 1:, None]).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _full(policy: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Unsharded model and optimizer state (a collective under FSDP2), FQN-keyed as on any layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    return {
        "model": get_model_state_dict(policy, options=opts),
        "optim": get_optimizer_state_dict(policy, opt, options=opts),
    }


def _assert_same_state(want: dict, got: dict) -> None:
    assert want["model"].keys() == got["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    ws, gs = want["optim"]["state"], got["optim"]["state"]
    assert ws.keys() == gs.keys() == {n for n, p in _Policy(0).named_parameters()}
    for name, entry in ws.items():
        assert set(entry) == set(gs[name]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], gs[name][key]), f"{name}.{key}"
    assert want["optim"]["param_groups"] == got["optim"]["param_groups"]


def _two_ranks(rank: int, store: str, from_one: str, written_by_two: str, out: str) -> None:
    """On 2 ranks, FSDP2: load the 1-rank checkpoint into a differently initialised policy, dump its full state,
    train on, save a 2-rank checkpoint and dump that state too."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        policy = _Policy(seed=7)
        for layer in policy.layers:  # as rlpipe.train.policy.shard_policy: one unit per block, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        opt = _adamw(policy)
        embed = policy.embed.weight
        assert type(embed).__name__ == "DTensor" and embed.to_local().shape[0] < embed.shape[0]  # really sharded
        cio.load_dcp(policy, opt, from_one)
        loaded = _full(policy, opt)
        if rank == 0:  # now: the state dict shares the optimizer's `step` tensors, which AdamW bumps in place
            torch.save(loaded, Path(out) / "loaded_on_2.pt")
        _train(policy, opt, 2, seed=100)
        cio.save_dcp(policy, opt, written_by_two)
        saved = _full(policy, opt)
        if rank == 0:
            torch.save(saved, Path(out) / "saved_on_2.pt")
    finally:
        dist.destroy_process_group()


def test_checkpoint_moves_between_one_replicated_rank_and_two_sharded_ranks(tmp_path):
    """1 -> 2 and 2 -> 1 with the same full model and optimizer state (bitwise), into policies initialised
    differently (seed 7, 9), so nothing passes by leaving the initial weights in place."""
    torch.manual_seed(0)
    policy = _Policy(seed=0)
    opt = _adamw(policy)
    _train(policy, opt, 2, seed=0)
    cio.save_dcp(policy, opt, tmp_path / "w1")  # no process group: plain tensors, as a 1-worker (or replicated) run
    saved_on_1 = _full(policy, opt)
    assert float(saved_on_1["optim"]["state"]["embed.weight"]["step"]) == 2.0

    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), str(tmp_path / "w1"), str(tmp_path / "w2"), str(tmp_path)),
             nprocs=2, join=True)  # fmt: skip
    _assert_same_state(saved_on_1, torch.load(tmp_path / "loaded_on_2.pt", weights_only=True))

    saved_on_2 = torch.load(tmp_path / "saved_on_2.pt", weights_only=True)
    assert float(saved_on_2["optim"]["state"]["embed.weight"]["step"]) == 4.0  # trained on after the 1 -> 2
    fresh = _Policy(seed=9)
    fresh_opt = _adamw(fresh)
    cio.load_dcp(fresh, fresh_opt, tmp_path / "w2")
    _assert_same_state(saved_on_2, _full(fresh, fresh_opt))


def test_a_different_model_shape_names_the_file_and_the_weight(tmp_path):
    small = _Policy(seed=0, hidden=16)
    cio.save_dcp(small, None, tmp_path / "w")
    with pytest.raises(CheckpointError) as err:
        cio.load_dcp(_Policy(seed=0, hidden=32), None, tmp_path / "w")
    msg = str(err.value)
    assert str(tmp_path / "w" / ".metadata") in msg
    assert "weight 'embed.weight' has shape [40, 16] in the checkpoint but [40, 32] in this model" in msg
    with pytest.raises(CheckpointError, match=r"no weight 'layers.2.0.weight' that this model has"):
        cio.load_dcp(_Policy(seed=0, layers=3), None, tmp_path / "w")
    with pytest.raises(CheckpointError, match="holds no optimizer state .*checkpoint.save_optimizer=false"):
        cio.load_dcp(small, _adamw(small), tmp_path / "w")


def _worker(step: int, rng: str = "r") -> dict:
    return {"optimizer_step": step, "skipped_steps": 1, "rng": rng}


def test_worker_states_keep_rng_at_the_same_world_size_and_reseed_on_another():
    saved = [_worker(5, "r0"), _worker(5, "r1")]
    assert cio.worker_states_for(saved, 2) == saved  # same world size: each rank its own RNG (bitwise continuation)
    assert cio.worker_states_for(saved, 1) == [{"optimizer_step": 5, "skipped_steps": 1, "rng": None}]
    assert cio.worker_states_for(saved[:1], 3) == [{"optimizer_step": 5, "skipped_steps": 1, "rng": None}] * 3
    with pytest.raises(
        CheckpointError, match=r"ckpt-x: worker_states disagree on optimizer_step \(rank 0: 5, rank 1: 6"
    ):
        cio.worker_states_for([_worker(5), _worker(6)], 1, where="ckpt-x")
    with pytest.raises(CheckpointError, match="no worker_states"):
        cio.worker_states_for([], 1)
    with pytest.raises(CheckpointError, match=r"worker_states\[0\] lacks rng"):
        cio.worker_states_for([{"optimizer_step": 1, "skipped_steps": 0}], 2)
    # the re-seed depends on rank and position (not a replay of the initial stream), and is reproducible
    seeds = {cio.resume_seed(0, rank, step) for rank in (0, 1) for step in (0, 5)}
    assert len(seeds) == 4 and cio.resume_seed(0, 1, 5) == cio.resume_seed(0, 1, 5)
    assert all(0 <= s < 2**64 for s in seeds)
