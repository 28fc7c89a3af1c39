"""Logprobs of label tokens without materialising ``[tokens, vocab]`` logits.

The LM head of a 150k-vocab model over a 16k-token pack would need ~10 GB of fp32 logits (plus as much again for
their gradient). ``chunked_logprobs`` loops over token chunks in forward and *recomputes* each chunk's logits in
backward, keeping only ``[chunk, vocab]`` alive at a time plus one logsumexp per token. Compute is in fp32 (fp64 if
the hidden states are fp64, which ``gradcheck`` needs), whatever the model dtype and even under autocast: a bf16
hidden state and head weight are upcast, so logits, logsumexp and the returned logprobs are fp32.

With ``z = h W^T / T`` and ``logp = z_y - logsumexp(z)``: ``dlogp/dz = onehot(y) - softmax(z)``, so for upstream
gradient ``g`` the chunk's ``grad_z = g (onehot - softmax)``, ``grad_h = grad_z W / T`` and ``grad_W += grad_z^T h / T``.
Labels equal to -100 (prompt, padding, last position) get logprob 0 and no gradient.

Temperature: RL scores with ``T = scoring_temperature(rollout.temperature)`` (old, current and reference logprobs,
and the rollout engine's logprobs), so the PPO ratio, the KL and rollout IS describe the distribution the rollout
sampled from (as verl divides the actor's and the reference's logits by the rollout temperature). ``T = 1`` skips
the division, so the default is bit-identical to untempered scoring. SFT cross-entropy is always at ``T = 1``.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def scoring_temperature(sampling_temperature: float) -> float:
    """Temperature to score the sampled tokens at: the sampling one, or 1 for greedy (``T = 0`` has no distribution;
    its tokens are scored under the plain policy)."""
    return float(sampling_temperature) if sampling_temperature > 0 else 1.0


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


class _ChunkedLogprob(torch.autograd.Function):
    """Forward: per-chunk logits -> logsumexp -> gather. Backward: recompute the chunk's softmax from the saved lse."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, temperature: float):
        dt = _compute_dtype(hidden)
        w = weight.to(dt)
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, 0)
        out = torch.zeros(n, dtype=dt, device=hidden.device)
        lse = torch.zeros(n, dtype=dt, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = hidden[s:e].to(dt) @ w.T
            if temperature != 1.0:
                logits = logits / temperature
            lse_c = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[s:e, None]).squeeze(1)
            lse[s:e] = lse_c
            out[s:e] = torch.where(valid[s:e], picked - lse_c, 0.0)
            del logits
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):  # fp32 even if backward runs under autocast
            return _ChunkedLogprob._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, safe, valid, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dt = _compute_dtype(hidden)
        w = weight.to(dt)
        t, n = ctx.temperature, hidden.shape[0]
        g = torch.where(valid, grad_out.to(dt), 0.0)
        grad_h = torch.zeros(hidden.shape, dtype=dt, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dt, device=weight.device) if need_w else None
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            g_c = g[s:e]
            if not bool(valid[s:e].any()):
                continue
            h_c = hidden[s:e].to(dt)
            logits = h_c @ w.T
            if t != 1.0:
                logits.div_(t)
            # In place: one [chunk, vocab] buffer becomes the gradient (no separate logits - lse and exp copies).
            grad_z = logits.sub_(lse[s:e, None]).exp_().mul_(-g_c[:, None])  # -g * softmax
            grad_z.scatter_add_(1, safe[s:e, None], g_c[:, None])  # + g * onehot
            if t != 1.0:
                grad_z.div_(t)
            if need_h:
                grad_h[s:e] = grad_z @ w
            if need_w:
                grad_w.addmm_(grad_z.T, h_c)
            del logits, grad_z
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log_softmax(hidden @ W^T / temperature)[label]`` per token (fp32), 0 where ``labels == -100``.

    ``hidden`` is ``[..., H]``, ``labels`` ``[...]``, ``lm_head_weight`` ``[V, H]``; the result has ``labels``' shape.
    Differentiable w.r.t. ``hidden`` and the weight; never holds more than ``[chunk_size, V]`` logits.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = labels.reshape(-1).to(device=hidden.device, dtype=torch.long)
    # Autocast (train.mixed_precision on a replicated policy) would run the logits matmul in bf16; the logprobs
    # are meant to be fp32 from end to end (backward disables it too).
    with torch.autocast(hidden.device.type, enabled=False):
        out = _ChunkedLogprob.apply(flat_h, lm_head_weight, flat_l, int(chunk_size), float(temperature))
    return out.reshape(labels.shape)


def eager_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference path: full ``log_softmax`` of all logits (memory ``[tokens, V]``), 0 where ``labels == -100``."""
    dt = _compute_dtype(hidden)
    logp = torch.log_softmax((hidden.to(dt) @ weight.to(dt).T) / temperature, dim=-1)
    valid = labels != IGNORE_INDEX
    picked = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, 0.0)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """SFT loss numerator: ``sum(-logprob)`` over labels != -100 (divide by the global label count yourself)."""
    return -chunked_logprobs(hidden, weight, labels, chunk_size).sum()
