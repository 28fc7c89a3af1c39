"""Packed forward: no attention across sequence boundaries; packed logprobs == per-sequence logprobs."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.errors import DataError
from rlpipe.models.packed import (
    check_packed_positions,
    expected_position_ids,
    lm_head_weight,
    packed_hidden_states,
    token_logprobs,
)
from rlpipe.models.packed_attention import PACKED_SDPA, pack_gather_index, scoring_attention
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model

VOCAB = 50


def _eager_chunked_logprobs(hidden, weight, labels, chunk_size):
    """Reference (test-only fallback): full logits, log_softmax, gather; 0 where label == -100."""
    logp = torch.log_softmax((hidden.float() @ weight.float().T), dim=-1)
    safe = labels.clamp(min=0)
    out = logp.gather(-1, safe[:, None]).squeeze(-1)
    return torch.where(labels == -100, torch.zeros_like(out), out)


@pytest.fixture(autouse=True)
def _chunked_logprobs_available(monkeypatch):
    try:
        import rlpipe.algos.logprobs  # noqa: F401
    except ImportError:
        fake = types.ModuleType("rlpipe.algos.logprobs")
        fake.chunked_logprobs = _eager_chunked_logprobs
        monkeypatch.setitem(sys.modules, "rlpipe.algos", types.ModuleType("rlpipe.algos"))
        monkeypatch.setitem(sys.modules, "rlpipe.algos.logprobs", fake)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    m = build_tiny_model(TinyModelConfig(arch=request.param, hidden_size=32, intermediate_size=64), VOCAB, seed=0)
    return m


def _sequences():
    g = torch.Generator().manual_seed(0)
    lens = [(3, 4), (5, 1), (2, 7)]  # (prompt, response) of different lengths
    return [
        (torch.randint(3, VOCAB, (p,), generator=g).tolist(), torch.randint(3, VOCAB, (r,), generator=g).tolist())
        for p, r in lens
    ]


def _reference_logprobs(model, prompt, response, temperature=1.0):
    """Naive loop: run one sequence alone through the full model and read log p(response_j | prefix) under
    softmax(logits / temperature)."""
    ids = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    out = []
    for j, tok in enumerate(response):
        out.append(logp[len(prompt) - 1 + j, tok].item())
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager", PACKED_SDPA])
def test_packed_logprobs_equal_per_sequence(model, attn):
    seqs = _sequences()
    refs = [torch.tensor(_reference_logprobs(model, p, r)) for p, r in seqs]  # one sequence at a time, sdpa
    items = [SequenceItem(p, r, row=i) for i, (p, r) in enumerate(seqs)]
    (pack,) = pack_sequences(items, pack_max_length=32, pad_token_id=0)  # one pack + a padding segment
    assert pack.num_sequences == 3
    model.set_attn_implementation(attn)
    try:
        with torch.no_grad():
            lp = token_logprobs(model, pack, chunk_size=4)
    finally:
        model.set_attn_implementation("sdpa")
    assert lp.shape == (32,)
    assert torch.all(lp[pack.shifted_labels == -100] == 0)
    for row, ref in enumerate(refs):
        got = lp[(pack.seq_index == row) & (pack.shifted_labels != -100)]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.3])
def test_packed_logprobs_at_a_sampling_temperature(model, temperature):
    """The trainer's old/current logprobs at T equal log_softmax(logits / T) of each sequence run alone (and differ
    from the untempered ones, so the check has teeth)."""
    seqs = _sequences()
    (pack,) = pack_sequences([SequenceItem(p, r, row=i) for i, (p, r) in enumerate(seqs)], 32, pad_token_id=0)
    with torch.no_grad():
        lp = token_logprobs(model, pack, chunk_size=4, temperature=temperature)
        untempered = token_logprobs(model, pack, chunk_size=4)
    scored = pack.shifted_labels != -100
    assert (lp[scored] - untempered[scored]).abs().max() > 1e-3
    for row, (p, r) in enumerate(seqs):
        got = lp[(pack.seq_index == row) & scored]
        torch.testing.assert_close(got, torch.tensor(_reference_logprobs(model, p, r, temperature)), atol=1e-5, rtol=0)


def test_tensor_form_equals_pack_form_and_hidden_is_isolated(model):
    seqs = _sequences()
    items = [SequenceItem(p, r, row=i) for i, (p, r) in enumerate(seqs)]
    (pack,) = pack_sequences(items, pack_max_length=32, pad_token_id=0)
    with torch.no_grad():
        a = token_logprobs(model, pack)
        b = token_logprobs(model, pack.input_ids, pack.position_ids, pack.cu_seq_lens, pack.shifted_labels, 1024)
        h = packed_hidden_states(model, pack.input_ids, pack.position_ids, pack.cu_seq_lens)
        # changing the first sequence must not change the hidden states of later ones
        ids2 = pack.input_ids.clone()
        first = pack.seq_index == pack.seq_index[0]
        ids2[first] = (ids2[first] + 1) % VOCAB
        h2 = packed_hidden_states(model, ids2, pack.position_ids, pack.cu_seq_lens)
    torch.testing.assert_close(a, b)
    assert h.shape == (32, model.config.hidden_size)
    torch.testing.assert_close(h[~first], h2[~first], atol=1e-6, rtol=0)
    assert not torch.allclose(h[first], h2[first])


def test_a_kv_cache_would_leak_across_sequences(model):
    """Why packed_hidden_states passes use_cache=False: with a cache transformers skips packed detection."""
    seqs = _sequences()
    (pack,) = pack_sequences([SequenceItem(p, r, row=i) for i, (p, r) in enumerate(seqs)], 32, 0)
    with torch.no_grad():
        leaky = model.get_decoder()(
            input_ids=pack.input_ids[None], position_ids=pack.position_ids[None], use_cache=True
        ).last_hidden_state[0]
        good = packed_hidden_states(model, pack.input_ids, pack.position_ids, pack.cu_seq_lens)
    assert not torch.allclose(leaky, good, atol=1e-3)


def test_lm_head_weight_tied_and_untied():
    tied = build_tiny_model(TinyModelConfig(hidden_size=16, intermediate_size=32), VOCAB, 0)
    assert lm_head_weight(tied).data_ptr() == tied.get_input_embeddings().weight.data_ptr()
    untied = build_tiny_model(
        TinyModelConfig(hidden_size=16, intermediate_size=32, tie_word_embeddings=False), VOCAB, 0
    )
    w = lm_head_weight(untied)
    assert w.shape == (VOCAB, 16) and w.data_ptr() != untied.get_input_embeddings().weight.data_ptr()


def test_position_checks():
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    assert expected_position_ids(cu, 8).tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    check_packed_positions(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]), cu)
    with pytest.raises(DataError, match="position 3"):
        check_packed_positions(torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), cu)
    with pytest.raises(DataError, match="cu_seq_lens"):
        expected_position_ids(torch.tensor([0, 3, 9]), 8)


def test_rejects_2d_input(model):
    with pytest.raises(DataError, match="1-D"):
        packed_hidden_states(model, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), None)


def _grads_of_pack_loss(model, pack):
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, pack, chunk_size=8)
    weights = torch.linspace(-1.0, 1.0, lp.numel())  # a loss that weighs every token differently
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_sdpa_matches_block_mask_sdpa_values_and_grads(model):
    """The per-sequence attention is the block-diagonal attention: same logprobs, same gradients (GQA model)."""
    g = torch.Generator().manual_seed(1)
    items = [
        SequenceItem(torch.randint(3, VOCAB, (p,), generator=g).tolist(), torch.randint(3, VOCAB, (r,), generator=g).tolist(), row=i)
        for i, (p, r) in enumerate([(1, 1), (6, 3), (2, 9), (4, 4), (3, 1)])
    ]  # fmt: skip
    (pack,) = pack_sequences(items, pack_max_length=48, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    lp_ref, grads_ref = _grads_of_pack_loss(model, pack)
    model.set_attn_implementation(PACKED_SDPA)
    try:
        lp, grads = _grads_of_pack_loss(model, pack)
    finally:
        model.set_attn_implementation("sdpa")
        model.zero_grad(set_to_none=True)
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_sdpa_refuses_unpacked_use(model):
    """Generation (batches, KV cache, no cu_seq_lens) must never run on the packed backend silently."""
    model.set_attn_implementation(PACKED_SDPA)
    try:
        with pytest.raises(RuntimeError, match="packed rows only"):
            model(input_ids=torch.randint(3, VOCAB, (2, 5)))
    finally:
        model.set_attn_implementation("sdpa")


def test_pack_gather_index_and_backend_choice():
    index, valid = pack_gather_index(torch.tensor([0, 2, 5, 6]), 3)
    assert index.tolist() == [[0, 1, 2], [2, 3, 4], [5, 5, 5]]
    assert valid.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert scoring_attention("sdpa") == PACKED_SDPA
    assert scoring_attention("sdpa", packed_attention=False) == "sdpa"
    assert scoring_attention("flash_attention_2") == "flash_attention_2"  # varlen already
