"""The memory layout of a sharded run (issue 18.4), on a real 2-process gloo group (TrainingWorker.setup, no Ray):
the policy is built on the meta device, sharded, then loaded shard by shard; the KL reference is FSDP2-sharded too.

Both must equal a plain `load_model` exactly (weights, tie, RoPE buffers), score the same logprobs as an independent
plain HF forward, give the same KL metric as the formula, train, and hold ~1/2 of the reference per rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

from rlpipe.config import load_config
from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.models.loading import load_model
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from rlpipe.train.distributed import free_port
from tests.conftest import random_items, tiny_overrides

SHAPES = {
    "qwen2-tied": TinyModelConfig(),
    "llama-untied": TinyModelConfig(arch="llama", tie_word_embeddings=False, num_layers=3, num_kv_heads=2),
}


def _items() -> list[SequenceItem]:
    items = random_items(5, 8, (2, 7))
    return items


def _packs():
    return pack_sequences(_items(), 32, pad_token_id=0, dp_size=2, pad_to_max_length=False)


def _rank_main(rank: int, port: int, runs: list[tuple[str, str, str, str]]) -> None:
    """Every shape in one spawn (the imports dominate a spawn's time); one process group for all."""
    from rlpipe.train.worker import TrainingWorker

    worker = None
    try:
        for cfg_json, policy_dir, ref_dir, out in runs:
            worker = TrainingWorker(cfg_json, policy_dir, rank, 2)
            worker.setup("127.0.0.1", port)  # joins the group once (idempotent)
            torch.save(_probe(worker, rank, ref_dir), out.format(rank=rank))
    finally:
        if worker is not None:
            worker.shutdown()


def _probe(worker, rank: int, ref_dir: str) -> dict:
    """What the test checks, measured inside one rank: layouts, full weights, logprobs, a fit step's KL."""
    from torch.distributed.tensor import DTensor

    from rlpipe.train.policy import full_hf_state_dict, load_sharded_weights, shard_reference

    packs = _packs()[rank::2]
    hf = worker.policy.hf
    result = {
        "sharded": worker._sharded,
        "ref_sharded": all(isinstance(p, DTensor) for p in worker.ref.parameters()),
        "tied": hf.get_output_embeddings().weight is hf.get_input_embeddings().weight,
        "buffers": {n: b.clone() for n, b in hf.named_buffers()},
        "ref_local_bytes": sum(p.to_local().numel() * p.element_size() for p in worker.ref.parameters()),
        "policy": full_hf_state_dict(worker.policy),
        "ref": full_hf_state_dict(worker.ref),
        "old_lp": worker.compute_logprobs(packs),
        "ref_lp": worker.compute_ref_logprobs(packs),
        "ref_root_resharded": all(isinstance(p, DTensor) for p in worker.ref.hf.get_input_embeddings().parameters()),
    }
    offloaded = worker._empty_policy(ref_dir)  # the GPU-only `train.ref_offload` layout, run on CPU here
    shard_reference(offloaded, worker.mesh["dp"], offload=True)
    load_sharded_weights(offloaded, ref_dir, "cpu")
    with torch.no_grad():
        result["offloaded_lp"] = [offloaded.logprobs(p, worker.temperature) for p in packs]
    before = worker.weights_digest()
    metrics = worker.fit(packs, [len(packs)], 0, 10)
    result.update(kl=metrics.kl, grad_norm=metrics.steps[0].grad_norm, moved=worker.weights_digest() != before)
    return result


def _hf_logprobs(model, item: SequenceItem) -> torch.Tensor:
    """Response-token logprobs under a plain HF forward of the unpacked sequence (independent of rlpipe's packing
    and chunked logprob)."""
    ids = torch.tensor([item.prompt_ids + item.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
    p = len(item.prompt_ids)
    return logp[p - 1 : -1].gather(-1, ids[0, p:, None]).squeeze(-1)


def _per_item(packs, values) -> dict[int, torch.Tensor]:
    """Row -> its response-token values, read out of the packs."""
    out = {}
    for pack, v in zip(packs, values, strict=True):
        for row in pack.seq_index.unique().tolist():
            mask = (pack.seq_index == row) & (pack.shifted_labels != -100)
            if row >= 0 and mask.any():
                out[row] = v[mask]
    return out


def _low_var_kl(old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 of the seed, written out: k = clamp(ref - old, +-20); clamp(e^k - k - 1, +-10)."""
    k = (ref.double() - old.double()).clamp(-20, 20)
    return (k.exp() - k - 1).clamp(-10, 10)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict[str, tuple[list[dict], str, str]]:
    """shape -> (per-rank results, policy dir, reference dir), from one 2-rank spawn over every shape."""
    root = tmp_path_factory.mktemp("sharded")
    runs, dirs = [], {}
    for shape, tiny in SHAPES.items():
        policy_dir = create_tiny_model_dir(root / shape / "policy", tiny, seed=1)
        ref_dir = create_tiny_model_dir(root / shape / "ref", tiny, seed=2)  # differs from the policy: KL > 0
        extra = {"train.world_size": 2, "train.fsdp": True, "algo.use_kl_loss": True, "train.ref_load_from": ref_dir}
        cfg = load_config(overrides=tiny_overrides(root / shape, **extra))
        runs.append((cfg.model_dump_json(), policy_dir, ref_dir, str(root / shape / "rank{rank}.pt")))
        dirs[shape] = (policy_dir, ref_dir, runs[-1][3])
    mp.spawn(_rank_main, args=(free_port(), runs), nprocs=2, join=True)
    return {
        shape: ([torch.load(out.format(rank=r), weights_only=True) for r in range(2)], policy_dir, ref_dir)
        for shape, (policy_dir, ref_dir, out) in dirs.items()
    }


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sharded_policy_and_reference_equal_the_plain_load(spawned, shape):
    ranks, policy_dir, ref_dir = spawned[shape]
    plain_policy, plain_ref = load_model(policy_dir), load_model(ref_dir)

    for res in ranks:
        assert res["sharded"] and res["ref_sharded"] and res["ref_root_resharded"]
        assert res["tied"] is plain_policy.config.tie_word_embeddings
        for got, plain in ((res["policy"], plain_policy), (res["ref"], plain_ref)):
            want = plain.state_dict()
            assert got.keys() == want.keys()
            assert [k for k in want if not torch.equal(got[k], want[k])] == []
        for name, value in plain_policy.named_buffers():  # RoPE inv_freq: recomputed, not left uninitialised
            assert torch.equal(res["buffers"][name], value), name

    # Per rank: half of the reference (dim-0 shards; the two halves add up to the whole model exactly).
    full_bytes = sum(p.numel() * p.element_size() for p in plain_ref.parameters())
    local = [res["ref_local_bytes"] for res in ranks]
    assert sum(local) == full_bytes and max(local) <= 0.51 * full_bytes

    packs = _packs()
    items = {item.row: item for item in _items()}
    old, ref, offloaded = {}, {}, {}
    for rank, res in enumerate(ranks):
        old |= _per_item(packs[rank::2], res["old_lp"])
        ref |= _per_item(packs[rank::2], res["ref_lp"])
        offloaded |= _per_item(packs[rank::2], res["offloaded_lp"])
    assert old.keys() == ref.keys() == items.keys()
    for row, item in items.items():
        torch.testing.assert_close(old[row], _hf_logprobs(plain_policy, item), rtol=0, atol=1e-5)
        torch.testing.assert_close(ref[row], _hf_logprobs(plain_ref, item), rtol=0, atol=1e-5)
        assert torch.equal(offloaded[row], ref[row])

    # The KL metric of the fit (old = the policy before its update, vs the sharded reference) is the formula's.
    kls = [_low_var_kl(_hf_logprobs(plain_policy, it), _hf_logprobs(plain_ref, it)) for it in items.values()]
    expected = torch.cat(kls)
    assert expected.mean().item() > 1e-4
    for res in ranks:
        assert res["kl"] == pytest.approx(expected.mean().item(), rel=1e-4)
        assert math.isfinite(res["grad_norm"]) and res["grad_norm"] > 0 and res["moved"]
