"""model.lora on real TrainingWorkers over 2 gloo ranks (spawned here, no Ray), replicated and FSDP2 layouts
(activation checkpointing, bf16 mixed precision, the chunked logprob at chunk_size 16): only
the adapters train and hold optimizer state, the KL reference is the base model, checkpoints hold the adapters and
resume exactly. One spawn for every variant (process start-up dominates)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlpipe.config import load_config
from rlpipe.data.packing import pack_sequences
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from tests.conftest import random_items, tiny_overrides

LAYOUTS = {
    "replicated": {"train.fsdp": False},
    "fsdp": {"train.fsdp": True, "train.activation_checkpointing": True},
    "fsdp_bf16": {"train.fsdp": True, "train.mixed_precision": "bf16"},
}
REF_TOLERANCE = {"fsdp_bf16": 0.05}  # bf16 compute (reference and policy alike) vs the fp32 base model: 1e-5 elsewhere


def _cfg(tmp: str, **extra):
    from pathlib import Path

    overrides = tiny_overrides(Path(tmp), **{"model.lora.enabled": True, "model.lora.rank": 4, "model.lora.alpha": 8,
                                             "train.world_size": 2, "algo.use_kl_loss": True, "algo.kl_coef": 0.1,
                                             "algo.chunk_size": 16, "train.lr": 1e-2, **extra})  # fmt: skip
    return load_config(overrides=overrides)


def _packs(seed: int):
    return pack_sequences(random_items(seed, 8, (2, 9)), 48, pad_token_id=0, pad_to_max_length=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _weights(worker) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in worker.policy.named_parameters()}


def _base_logprobs(model_dir: str, packs) -> list[torch.Tensor]:
    """A separately loaded base model (no adapters), scored through the same packed forward."""
    from rlpipe.models.loading import load_model
    from rlpipe.models.packed_attention import scoring_attention
    from rlpipe.train.policy import PolicyModel

    base = PolicyModel(load_model(model_dir, attn_implementation=scoring_attention("sdpa", True)), chunk_size=16)
    with torch.no_grad():
        return [base.logprobs(p) for p in packs]


def _worker(cfg, model_dir: str, rank: int, port: int):
    from rlpipe.train.worker import TrainingWorker

    w = TrainingWorker(cfg.model_dump_json(), model_dir, rank, 2)
    w.setup("127.0.0.1", port)  # joins the process group once per process (idempotent), then builds the policy
    return w


def _layout(name: str, tmp: str, model_dir: str, rank: int, port: int) -> dict:
    cfg = _cfg(tmp, **LAYOUTS[name])
    w = _worker(cfg, model_dir, rank, port)
    before = _weights(w)
    mine = _packs(20 + rank)
    w.fit(mine, [len(mine) // 2, len(mine) - len(mine) // 2], iteration=0, total_steps=10)
    after = _weights(w)
    probe = _packs(99)
    result = {
        "trainable": sorted(n for n, p in w.policy.named_parameters() if p.requires_grad),
        "optimizer_params": sum(len(g["params"]) for g in w.optimizer.param_groups),
        "optimizer_states": len(w.optimizer.state),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "after": after,
        "ref": w.compute_ref_logprobs(probe),
        "policy": w.compute_logprobs(probe),
        "base": _base_logprobs(model_dir, probe),
    }
    ckpt = f"{tmp}/ckpt-{name}"
    state = w.save(ckpt)
    next_packs = _packs(40 + rank)
    w.fit(next_packs, [len(next_packs)], iteration=1, total_steps=10)
    result["continued"] = w.weights_digest()
    fresh = _worker(cfg, model_dir, rank, port)
    fresh.load(ckpt, state)
    fresh.fit(next_packs, [len(next_packs)], iteration=1, total_steps=10)
    result["resumed"] = fresh.weights_digest()
    from torch.distributed.checkpoint import FileSystemReader

    result["checkpoint_keys"] = sorted(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    return result


def _rank_main(rank: int, tmp: str, model_dir: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    try:
        results = {name: _layout(name, tmp, model_dir, rank, port) for name in LAYOUTS}
        if rank == 0:
            torch.save(results, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-train")
    model_dir = create_tiny_model_dir(root / "tiny", TinyModelConfig(), seed=0)
    out = root / "result.pt"
    mp.spawn(_rank_main, args=(str(root), str(model_dir), _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_only_adapters_train_and_the_optimizer_holds_only_their_state(lora_results, layout):
    r = lora_results[layout]
    assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
    # 2 layers x 7 projections (q,k,v,o,gate,up,down) x (A, B)
    assert len(r["trainable"]) == 2 * 7 * 2
    assert r["optimizer_params"] == len(r["trainable"]) == r["optimizer_states"]
    # the update moved adapters and nothing else (B starts at 0, so the first step moves every B)
    assert r["changed"] and set(r["changed"]) <= set(r["trainable"])
    assert any(".lora_B." in n for n in r["changed"])


def test_replicated_and_fsdp2_layouts_take_the_same_lora_step(lora_results):
    rep, fsdp = lora_results["replicated"]["after"], lora_results["fsdp"]["after"]
    assert rep.keys() == fsdp.keys()
    for name in rep:
        torch.testing.assert_close(fsdp[name], rep[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kl_reference_is_the_base_model_with_adapters_off(lora_results, layout):
    r = lora_results[layout]
    for ref, base in zip(r["ref"], r["base"], strict=True):
        torch.testing.assert_close(ref, base, rtol=0, atol=REF_TOLERANCE.get(layout, 1e-5))
    # the trained adapters do change the policy, so the equality above is not trivially the policy itself
    assert max(float((p - b).abs().max()) for p, b in zip(r["policy"], r["base"], strict=True)) > 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_checkpoint_holds_adapters_and_optimizer_and_resumes_exactly(lora_results, layout):
    r = lora_results[layout]
    weights = [k.removeprefix("model.") for k in r["checkpoint_keys"] if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights[:5]
    assert len(weights) == len(r["trainable"])
    assert any(k.startswith("optim.state.") and "exp_avg" in k for k in r["checkpoint_keys"])
    assert r["resumed"] == r["continued"]
