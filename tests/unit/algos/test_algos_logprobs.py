"""Chunked logprobs: values and gradients equal the eager log_softmax path; gradcheck; no [N, V] tensor is saved."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algos.logprobs import chunked_cross_entropy, chunked_logprobs, eager_logprobs


def _data(n=37, h=16, v=50, seed=0, ignore=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore] = -100
    return hidden, weight, labels


def _naive(hidden, weight, labels):
    """Python loop over tokens: log-softmax of one row of logits at a time."""
    out = []
    for t in range(hidden.shape[0]):
        if labels[t] == -100:
            out.append(0.0)
            continue
        z = (weight.double() @ hidden[t].double()).tolist()
        m = max(z)
        lse = m + torch.tensor([x - m for x in z], dtype=torch.float64).exp().sum().log().item()
        out.append(z[labels[t]] - lse)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 37, 1024])
@pytest.mark.parametrize("ignore", [0.3, 1.0])
def test_values_and_gradients_equal_eager(chunk_size, ignore):
    hidden, weight, labels = _data(ignore=ignore)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    upstream = torch.randn(hidden.shape[0])
    out = chunked_logprobs(h1, w1, labels, chunk_size)
    ref = eager_logprobs(h2, w2, labels)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[labels == -100], torch.zeros(int((labels == -100).sum())))
    if ignore == 1.0:
        assert torch.equal(h1.grad, torch.zeros_like(h1)) and torch.equal(w1.grad, torch.zeros_like(w1))


def test_eager_matches_python_loop():
    hidden, weight, labels = _data(n=9)
    torch.testing.assert_close(eager_logprobs(hidden, weight, labels).double(), _naive(hidden, weight, labels),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_gradcheck_float64_with_temperature():
    hidden, weight, labels = _data(n=7, h=4, v=6, dtype=torch.float64, ignore=0.3)
    hidden.requires_grad_()
    weight.requires_grad_()
    for temperature in (1.0, 0.7):
        assert torch.autograd.gradcheck(
            lambda h, w, t=temperature: chunked_logprobs(h, w, labels, 3, t), (hidden, weight)
        )
    torch.testing.assert_close(
        chunked_logprobs(hidden, weight, labels, 3, 0.7), eager_logprobs(hidden, weight, labels, 0.7)
    )


def test_low_precision_inputs_and_batched_shape():
    hidden, weight, labels = _data(n=24)
    hb = hidden.to(torch.bfloat16).requires_grad_()
    out = chunked_logprobs(hb, weight.to(torch.bfloat16), labels, 5)
    assert out.dtype == torch.float32  # computed in fp32 whatever the model dtype
    torch.testing.assert_close(
        out, eager_logprobs(hb.detach(), weight.to(torch.bfloat16), labels), atol=1e-5, rtol=1e-5
    )
    out.sum().backward()
    assert hb.grad.dtype == torch.bfloat16
    # [B, T, H] hidden with [B, T] labels
    out2 = chunked_logprobs(hidden.reshape(4, 6, -1), weight, labels.reshape(4, 6), 5)
    torch.testing.assert_close(out2, chunked_logprobs(hidden, weight, labels, 5).reshape(4, 6))


def test_cross_entropy_is_sum_of_negative_logprobs():
    hidden, weight, labels = _data()
    h = hidden.clone().requires_grad_()
    ce = chunked_cross_entropy(h, weight, labels, chunk_size=6)
    valid = labels != -100
    expected = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(ce, expected, atol=1e-4, rtol=1e-5)
    ce.backward()
    assert h.grad[~valid].abs().max() == 0


def test_never_saves_full_logits():
    n, v = 64, 200
    hidden, weight, labels = _data(n=n, h=8, v=v)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = chunked_logprobs(hidden, weight, labels, chunk_size=16)
    assert saved and max(saved) < n * v / 2  # hidden, weight, labels, lse only
    out.sum().backward()


def test_bad_arguments():
    hidden, weight, labels = _data(n=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, labels, 2, 0.0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_logprobs(hidden, weight, labels[:3], 2)
