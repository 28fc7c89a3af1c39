"""Activation checkpointing, bf16 mixed precision, the AdamW kernel choice and torch.compile of the decoder layers
(`train.activation_checkpointing`, `train.mixed_precision`, `train.optimizer_impl`, `train.compile`).

Single-process here; the same features under FSDP2 over 2 gloo ranks are in test_precision_fsdp.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.config import load_config
from rlpipe.data.packing import pack_sequences
from rlpipe.errors import ConfigError
from rlpipe.models.loading import load_model
from rlpipe.models.packed_attention import scoring_attention
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from rlpipe.train.optim import build_optimizer, resolve_optimizer_impl, set_optimizer_impl
from rlpipe.train.policy import PolicyModel, apply_activation_checkpointing, compile_decoder_layers
from tests.conftest import in_process_worker, random_items, tiny_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("precision") / "tiny"
    create_tiny_model_dir(path, TinyModelConfig(), seed=0)
    return str(path)


def packs(seed: int = 3, rows: int = 8, pack_len: int = 48):
    items = random_items(seed, rows, (2, 9))
    return pack_sequences(items, pack_len, pad_token_id=0, pad_to_max_length=False)


def policy_of(model_dir: str) -> PolicyModel:
    hf = load_model(model_dir, attn_implementation=scoring_attention("sdpa", True))
    hf.config.use_cache = False
    return PolicyModel(hf.train(), chunk_size=16)


def weighted_loss(policy: PolicyModel, pack) -> torch.Tensor:
    """A loss whose gradient reaches every weight through every label position (fixed per-token weights)."""
    logprobs = policy.logprobs(pack)
    weights = torch.linspace(-1.0, 2.0, logprobs.numel())
    return (logprobs * weights).sum()


def grads_after_backward(policy: PolicyModel, pack) -> dict[str, torch.Tensor]:
    policy.zero_grad(set_to_none=True)
    weighted_loss(policy, pack).backward()
    return {name: p.grad.clone() for name, p in policy.named_parameters()}


def saved_activation_bytes(policy: PolicyModel, pack) -> int:
    """Bytes autograd saves for backward during one forward (what activation checkpointing is meant to cut)."""
    total = 0

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        weighted_loss(policy, pack).backward()
    return total


# ------------------------------------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_gives_the_same_gradients_and_saves_less(model_dir):
    pack = packs()[0]
    plain, checkpointed = policy_of(model_dir), policy_of(model_dir)
    names = [n for n, _ in plain.named_parameters()]
    apply_activation_checkpointing(checkpointed.hf)
    assert [n for n, _ in checkpointed.named_parameters()] == names  # no wrapper prefix in the parameter names
    expected, got = grads_after_backward(plain, pack), grads_after_backward(checkpointed, pack)
    for name in names:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(g.abs().sum() > 0 for g in expected.values())
    # The checkpointed layers save only their inputs: far fewer bytes than the layers' full activations.
    assert saved_activation_bytes(checkpointed, pack) < 0.6 * saved_activation_bytes(plain, pack)


# ------------------------------------------------------------------------------------------- mixed precision


def test_chunked_logprobs_stay_fp32_under_autocast():
    """The logits matmul must not be run in bf16 by an enclosing autocast: results equal the fp32 path exactly."""
    from rlpipe.algos.logprobs import chunked_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 16, generator=g, requires_grad=True)
    weight = (torch.randn(50, 16, generator=g) / 4).requires_grad_()
    labels = torch.randint(0, 50, (20,), generator=g)
    ref = chunked_logprobs(hidden, weight, labels, chunk_size=7)
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    with torch.autocast("cpu", torch.bfloat16):
        out = chunked_logprobs(hidden, weight, labels, chunk_size=7)
        grads = torch.autograd.grad(out.sum(), (hidden, weight))  # backward inside autocast, too
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_mixed_precision_with_a_bf16_model_dtype_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"mixed_precision.*model\.dtype"):
        load_config(overrides=tiny_overrides(tmp_path, **{"train.mixed_precision": "bf16", "model.dtype": "bfloat16"}))


def sft_run(tmp_path, model_dir: str, mixed_precision: str, steps: int):
    """`steps` SFT updates of a replicated policy built by the worker (`_build_policy`) with the given setting."""
    overrides = {"train.mixed_precision": mixed_precision, "train.lr": 3e-3, "train.warmup_steps": 0}
    cfg = load_config(overrides=tiny_overrides(tmp_path / mixed_precision, **overrides))
    worker = in_process_worker(cfg, model_dir)
    torch.manual_seed(0)
    worker.policy = worker._build_policy(model_dir)
    worker.optimizer = build_optimizer(worker.policy.parameters(), cfg.train)
    data = packs(rows=12, pack_len=64)
    losses = [worker.fit_sft(data, steps).loss for _ in range(steps)]
    return worker, losses


MP_STEPS = 10
MP_LOSS_RTOL = 0.01  # bf16 keeps 8 mantissa bits (~0.4% per rounding); measured here: 0.04% (0.4% over 20 steps)


def test_bf16_mixed_precision_tracks_fp32_and_keeps_fp32_masters(tmp_path, model_dir):
    fp32, fp32_losses = sft_run(tmp_path, model_dir, "off", MP_STEPS)
    bf16, bf16_losses = sft_run(tmp_path, model_dir, "bf16", MP_STEPS)
    assert bf16.policy.autocast_dtype is torch.bfloat16 and fp32.policy.autocast_dtype is None
    assert fp32_losses[-1] < 0.8 * fp32_losses[0]  # the runs learn, so "tracking" compares moving curves
    for step, (a, b) in enumerate(zip(bf16_losses, fp32_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=MP_LOSS_RTOL), (step, a, b)
    assert bf16_losses != fp32_losses  # the bf16 run really computed in bf16
    for p in bf16.policy.parameters():
        assert p.dtype == torch.float32
        state = bf16.optimizer.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    bf16.policy.eval()
    with torch.no_grad():
        logprobs = bf16.policy.logprobs(packs()[0])
    assert logprobs.dtype == torch.float32


# ------------------------------------------------------------------------------------------- AdamW kernels


def test_optimizer_impl_auto_picks_fused_where_torch_has_it_and_foreach_elsewhere():
    assert resolve_optimizer_impl("auto", "cuda") == "fused"
    assert resolve_optimizer_impl("auto", "cpu") == "fused"
    assert resolve_optimizer_impl("auto", "meta") == "foreach"
    assert resolve_optimizer_impl("for_loop", "cuda") == "for_loop"
    assert resolve_optimizer_impl("fused", "cpu") == "fused"
    with pytest.raises(ValueError, match="optimizer_impl=fused"):
        resolve_optimizer_impl("fused", "meta")
    with pytest.raises(ValueError, match="optimizer_impl='sgd'"):
        resolve_optimizer_impl("sgd", "cpu")


def test_optimizer_impl_is_validated_in_the_config(tmp_path):
    with pytest.raises(ConfigError, match="optimizer_impl"):
        load_config(overrides=tiny_overrides(tmp_path, **{"train.optimizer_impl": "sgd"}))


def adamw_reference(p0, grads, lr, betas, eps, wd):
    """AdamW written out (Loshchilov & Hutter, torch's bias-corrected form), independent of torch.optim."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["for_loop", "foreach", "fused"])
def test_every_adamw_kernel_gives_the_reference_update(tmp_path, impl):
    cfg = load_config(overrides=tiny_overrides(tmp_path, **{"train.optimizer_impl": impl, "train.lr": 0.01,
                                                           "train.weight_decay": 0.1}))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(4)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = build_optimizer(params, cfg.train, "cpu")
    group = opt.param_groups[0]
    assert (group["fused"], group["foreach"]) == (impl == "fused", impl == "foreach")
    for step_grads in grads:
        for p, grad in zip(params, step_grads, strict=True):
            p.grad = grad.clone()
        opt.step()
    for i, p in enumerate(params):
        expected = adamw_reference(start[i], [s[i] for s in grads], 0.01, cfg.train.betas, 1e-8, 0.1)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_a_loaded_optimizer_state_keeps_the_configured_kernel(tmp_path):
    """load_state_dict restores the writer's fused/foreach flags; set_optimizer_impl puts the configured ones back,
    moving step counters where the fused kernel wants them, and the resumed updates equal an uninterrupted run."""
    cfg = load_config(overrides=tiny_overrides(tmp_path, **{"train.optimizer_impl": "for_loop"}))
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(6, generator=g) for _ in range(3)]
    a = torch.nn.Parameter(torch.ones(6))
    opt_a = build_optimizer([a], cfg.train)
    for grad in grads:
        a.grad = grad.clone()
        opt_a.step()
    b = torch.nn.Parameter(torch.ones(6))
    opt_b = build_optimizer([b], cfg.train)
    b.grad = grads[0].clone()
    opt_b.step()
    fused_cfg = cfg.train.model_copy(update={"optimizer_impl": "fused"})
    c = torch.nn.Parameter(b.detach().clone())
    opt_c = build_optimizer([c], fused_cfg)
    opt_c.load_state_dict(opt_b.state_dict())
    assert opt_c.param_groups[0]["fused"] is False  # the writer's flag came back with the state
    set_optimizer_impl(opt_c, "fused")
    assert opt_c.param_groups[0]["fused"] is True
    for grad in grads[1:]:
        c.grad = grad.clone()
        opt_c.step()
    torch.testing.assert_close(c.detach(), a.detach(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------- torch.compile


@pytest.mark.slow  # inductor compiles the layers with the system C++ compiler: ~2 min on 2 shared cores
def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients(model_dir):
    pack = packs()[0]
    eager, compiled = policy_of(model_dir), policy_of(model_dir)
    compile_decoder_layers(compiled.hf)
    names = [n for n, _ in eager.named_parameters()]
    assert [n for n, _ in compiled.named_parameters()] == names
    with torch.no_grad():
        torch.testing.assert_close(compiled.logprobs(pack), eager.logprobs(pack), rtol=1e-5, atol=1e-5)
    expected, got = grads_after_backward(eager, pack), grads_after_backward(compiled, pack)
    for name in names:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
