"""The trainer's global invariants, through real Ray actors (gloo): dp parity, resume parity, determinism."""

from __future__ import annotations

import json

import pytest
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config
from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.loop import run_segment
from rlpipe.train.controller import TrainingController

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")


def _synthetic_packs(cfg, vocab: int, pad: int):
    gen = torch.Generator().manual_seed(0)
    items = []
    for row in range(12):
        p = int(torch.randint(3, 9, (1,), generator=gen))
        r = int(torch.randint(2, 7, (1,), generator=gen))
        ids = torch.randint(5, vocab, (p + r,), generator=gen).tolist()
        items.append(
            SequenceItem(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                advantage=float(torch.randn(1, generator=gen)),
                rollout_logprobs=(-torch.rand(r, generator=gen) * 3).tolist(),
                row=row,
            )
        )
    return [
        pack_sequences(items[:7], 24, pad, dp_size=2, pad_to_max_length=False),
        pack_sequences(items[7:], 24, pad, dp_size=2, pad_to_max_length=False),
    ]


def _fit_once(tmp_path, world_size: int, **extra):
    cfg = load_config(overrides=tiny_overrides(tmp_path, **{"train.world_size": world_size,
                                                           "train.optimizer_steps": 2, **extra}))  # fmt: skip
    model_dir = prepare_base_model(cfg)
    controller = TrainingController(cfg, model_dir)
    try:
        vocab = json.loads((tmp_path / "out").glob("base-models/*/config.json").__next__().read_text())["vocab_size"]
        packs = _synthetic_packs(cfg, vocab, 0)
        # Perturb the policy away from old logprobs first so the ratio/clip paths are exercised.
        first = controller.fit(packs, 1, 10)
        second = controller.fit(packs, 2, 10)
        return first, second, controller.weights_digest()
    finally:
        controller.shutdown()


@pytest.mark.parametrize(
    "layout",
    [{"train.fsdp": True}, {"train.fsdp": True, "train.fsdp_reshard_after_forward": True}, {"train.fsdp": False}],
    ids=["fsdp-keep-gathered", "fsdp-reshard", "replicated"],
)
def test_world_size_1_and_2_give_the_same_loss_and_grad_norm(tmp_path, layout):
    """`auto` keeps the tiny model's gathered weights to the backward; resharding gathers them again; replicated
    (no FSDP) sums the gradients over ranks in flat buckets: the same numbers as one rank in every layout."""
    one = _fit_once(tmp_path / "w1", 1)
    two = _fit_once(tmp_path / "w2", 2, **layout)
    for m1, m2 in zip(one[:2], two[:2], strict=True):
        assert len(m1.steps) == len(m2.steps) == 2
        assert m1.train_entropy == pytest.approx(m2.train_entropy, rel=1e-5)
        assert m1.mismatch["mismatch_kl"] == pytest.approx(m2.mismatch["mismatch_kl"], rel=1e-5)
        for s1, s2 in zip(m1.steps, m2.steps, strict=True):
            assert s1.tokens == s2.tokens
            assert s1.loss == pytest.approx(s2.loss, rel=1e-4, abs=1e-6)
            assert s1.grad_norm == pytest.approx(s2.grad_norm, rel=1e-4)
            assert s1.clip_frac_high == pytest.approx(s2.clip_frac_high)


def _run(tmp_path, k_first: int, total: int):
    cfg = load_config(overrides=tiny_overrides(tmp_path, iterations=total, **{"sft.enabled": True,
                                                                              "sft.global_batch_size": 4}))  # fmt: skip
    first = run_segment(cfg, None, k_first)
    rows = list(first.metrics)
    ckpt = first.checkpoint
    if k_first < total:
        second = run_segment(cfg, ckpt, total - k_first)
        rows += second.metrics
        ckpt = second.checkpoint
    return rows, ckpt


def test_resume_parity_with_sft(tmp_path):
    straight, ckpt_a = _run(tmp_path / "a", 6, 6)
    resumed, ckpt_b = _run(tmp_path / "b", 3, 6)
    assert len(straight) == len(resumed) == 6
    timing = ("time", "per_s", "peak_memory")
    for ra, rb in zip(straight, resumed, strict=True):
        keys = {k for k in ra if not any(t in k for t in timing)}
        assert keys == {k for k in rb if not any(t in k for t in timing)}
        for k in keys:
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-9), k
    assert "sft/loss" in straight[0]
    from safetensors.torch import load_file  # noqa: F401  (weights compared by digest below)

    from rlpipe.session import RLSession

    digests = []
    for root, ck in ((tmp_path / "a", ckpt_a), (tmp_path / "b", ckpt_b)):
        cfg = load_config(overrides=tiny_overrides(root, iterations=6, **{"sft.enabled": True,
                                                                          "sft.global_batch_size": 4}))  # fmt: skip
        session = RLSession(cfg, prepare_base_model(cfg), ck)
        digests.append(session.controller.weights_digest())
        session.close()
    assert digests[0] == digests[1]


def test_shared_prompt_packing_trains_like_unshared(tmp_path):
    """One iteration (2 optimizer steps, 2 ranks) with and without shared-prompt packs: same rollout, same numbers."""
    rows = []
    for share in (True, False):
        extra = {"train.share_prompts": share, "train.world_size": 2, "train.optimizer_steps": 2, "iterations": 1}
        cfg = load_config(overrides=tiny_overrides(tmp_path / str(share), **extra))
        rows.append(run_segment(cfg, None, 1).metrics[0])
    shared, plain = rows
    assert shared["reward_mean"] == plain["reward_mean"] and shared["tokens"] == plain["tokens"]
    assert shared["train_tokens_per_s"] * shared["fit_time_s"] == pytest.approx(
        plain["train_tokens_per_s"] * plain["fit_time_s"], rel=1e-6
    )  # the same sequence tokens are counted whichever the layout
    for key in ("loss", "grad_norm", "train_entropy", "mismatch/mismatch_kl", "clip_frac_high", "ratio_max"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_a_replicated_checkpoint_loads_sharded_and_replicated(tmp_path):
    """2 ranks: a checkpoint saved by a replicated policy (DCP, optimizer included) loads into an FSDP2 policy and a
    replicated one with the same weights, so `train.fsdp` (or a model crossing the auto threshold) can change on
    resume."""
    from rlpipe.session import RLSession

    def cfg_for(fsdp: bool):
        extra = {"train.world_size": 2, "train.fsdp": fsdp, "iterations": 2}
        return load_config(overrides=tiny_overrides(tmp_path, **extra))

    ckpt = run_segment(cfg_for(False), None, 2).checkpoint
    digests = {}
    for fsdp in (True, False):
        cfg = cfg_for(fsdp)
        session = RLSession(cfg, prepare_base_model(cfg), ckpt)
        try:
            digests[fsdp] = session.controller.weights_digest()
        finally:
            session.close()
    assert digests[True] == digests[False]
