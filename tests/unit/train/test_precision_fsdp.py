"""Activation checkpointing, bf16 mixed precision and the AdamW kernels on an FSDP2-sharded policy: 2 gloo ranks
spawned here (no Ray), one spawn for all variants (process start-up dominates)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from tests.unit.train.test_precision_and_memory import packs, policy_of, weighted_loss


def _sharded(model_dir: str, mesh, activation_checkpointing: bool = False, mixed_precision: str = "off"):
    from rlpipe.train.policy import apply_layer_options, mixed_precision_policy, shard_policy

    torch.manual_seed(0)
    policy = policy_of(model_dir)
    apply_layer_options(policy.hf, activation_checkpointing, compile_layers=False)
    return shard_policy(policy, mesh, reshard_after_forward=True, mp_policy=mixed_precision_policy(mixed_precision))


def _full_grads(policy) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in policy.named_parameters()}


def _variant(model_dir: str, mesh, pack, **options) -> dict:
    policy = _sharded(model_dir, mesh, **options)
    logprobs = policy.logprobs(pack)
    weighted_loss(policy, pack).backward()
    local = [p.to_local() for p in policy.parameters()]
    return {
        "grads": _full_grads(policy),
        "logprobs": logprobs.detach(),
        "param_dtypes": {p.dtype for p in local},
        "grad_dtypes": {p.grad.to_local().dtype for p in policy.parameters()},
    }


def _optimizer_step(model_dir: str, mesh, pack, impl: str) -> dict[str, torch.Tensor]:
    """Three AdamW steps with `impl` on the sharded (DTensor) parameters; the full weights afterwards.

    Every step reuses the first backward's gradients: a fresh backward at the slightly different weights each
    kernel reaches would be amplified by Adam's normalisation where a gradient is at noise level (the k_proj bias
    has an exactly-zero true gradient), hiding what is compared here: the kernels' arithmetic.
    """
    from rlpipe.config import TrainConfig
    from rlpipe.train.optim import build_optimizer

    policy = _sharded(model_dir, mesh)
    opt = build_optimizer(policy.parameters(), TrainConfig(optimizer_impl=impl, lr=1e-2, weight_decay=0.1), "cpu")
    weighted_loss(policy, pack).backward()
    grads = [p.grad.detach().clone() for p in policy.parameters()]
    for _ in range(3):
        for p, g in zip(policy.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
    states = {s["exp_avg"].to_local().dtype for s in opt.state.values()}
    assert states == {torch.float32}, states
    return {name: p.full_tensor().detach().clone() for name, p in policy.named_parameters()}


def _rank_main(rank: int, store: str, model_dir: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        pack = packs(seed=10 + rank)[0]  # each rank its own data: FSDP2 averages the grads over ranks
        result = {
            "plain": _variant(model_dir, mesh, pack),
            "checkpointed": _variant(model_dir, mesh, pack, activation_checkpointing=True),
            "bf16": _variant(model_dir, mesh, pack, mixed_precision="bf16"),
            "bf16_checkpointed": _variant(model_dir, mesh, pack, activation_checkpointing=True, mixed_precision="bf16"),
            "optim": {impl: _optimizer_step(model_dir, mesh, pack, impl) for impl in ("for_loop", "foreach", "fused")},
        }
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("precision-fsdp")
    model_dir = create_tiny_model_dir(root / "tiny", TinyModelConfig(), seed=0)
    out = root / "result.pt"
    mp.spawn(_rank_main, args=(str(root / "store"), str(model_dir), str(out)), nprocs=2, join=True)
    return torch.load(out, weights_only=True)


def test_activation_checkpointing_under_fsdp2_gives_the_same_gradients(sharded_results):
    plain, checkpointed = sharded_results["plain"]["grads"], sharded_results["checkpointed"]["grads"]
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("variant", ["bf16", "bf16_checkpointed"])
def test_fsdp2_bf16_keeps_fp32_shards_grads_and_logprobs(sharded_results, variant):
    bf16, fp32 = sharded_results[variant], sharded_results["plain"]
    assert bf16["param_dtypes"] == {torch.float32} and bf16["grad_dtypes"] == {torch.float32}
    assert bf16["logprobs"].dtype == torch.float32
    # bf16 compute: close to fp32 but not equal (the policy really ran in bf16).
    assert not torch.equal(bf16["logprobs"], fp32["logprobs"])
    torch.testing.assert_close(bf16["logprobs"], fp32["logprobs"], rtol=0, atol=0.05)
    for name, g in fp32["grads"].items():
        error = (bf16["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert error < 0.05, (name, float(error))


def test_adamw_kernels_agree_on_sharded_parameters(sharded_results):
    weights = sharded_results["optim"]
    for impl in ("foreach", "fused"):
        for name, w in weights["for_loop"].items():
            torch.testing.assert_close(weights[impl][name], w, rtol=1e-6, atol=1e-7, msg=f"{impl}: {name}")
