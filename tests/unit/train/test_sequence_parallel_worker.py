"""`train.sp_size`: real TrainingWorkers on spawned gloo groups (no Ray) against one in-process worker (sp 1).

On the same packs, sp = 2 must give the same per-token old and reference logprobs, the same RL metrics (losses,
entropy, KL, clip fractions, rollout IS, grad norm) and the same gradients of every optimizer step for every
policy loss x aggregation mode (with KL and each rollout-IS level), the on-policy path, and SFT. Two layouts: the
replicated one (gradients all-reduced) on sp = 2 x dp = 1, and FSDP2 on dp = 2 x sp = 2 over four ranks, whose
mini-batches are sharded over dp as the controller does (`mesh_shards`). The optimizer step is replaced by a
recorder, so every variant starts from the same weights and the gradients are compared directly (fp32).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from rlpipe.algos.policy_loss import AGG_MODES
from rlpipe.config import AlgoConfig, load_config
from rlpipe.data.packing import IGNORE_INDEX, mesh_shards, pack_sequences
from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir
from tests.conftest import in_process_worker, random_items, tiny_overrides

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask", "both")
TIMINGS = {"fit_time_s", "logprob_time_s", "step_time_s", "peak_memory_mb"}


def _variants(full: bool) -> list[tuple[dict, bool]]:
    """(algo overrides, pass recomputed old logprobs): every loss x aggregation with KL and rollout IS, then the
    on-policy path (old logprobs from the training forward)."""
    out = []
    for i, (loss, agg) in enumerate((lo, a) for lo in ("ppo_clip", "gspo") for a in AGG_MODES):
        if not full and i % 3:
            continue
        clip = {"clip_low": 0.02, "clip_high": 0.03} if loss == "gspo" else {"clip_low": 0.05, "clip_high": 0.05}
        ris = {"enabled": True, "level": LEVELS[i % 3], "mode": MODES[i % 3], "upper": 1.5,
               "veto_threshold": 0.5 if i % 2 else None}  # fmt: skip
        out.append(({"policy_loss": loss, "loss_agg": agg, "use_kl_loss": True, "kl_coef": 0.5,
                     "kl_kind": ("k1", "k2", "low_var_kl")[i % 3], "rollout_is": ris, **clip}, True))  # fmt: skip
    out.append(({"policy_loss": "ppo_clip", "loss_agg": "token-mean", "use_kl_loss": False}, False))
    return out


def _config(tmp_path, world_size: int, sp_size: int, fsdp: bool, model_dir: str):
    overrides = {"train.world_size": world_size, "train.sp_size": sp_size, "train.fsdp": fsdp,
                 "train.grad_clip": 1e9, "rollout.temperature": 0.8, "algo.use_kl_loss": True,
                 "algo.chunk_size": 16, "model.path": model_dir}  # fmt: skip
    return load_config(overrides=tiny_overrides(tmp_path, **overrides))


def _record_steps(worker, grads: list) -> None:
    """Replace the optimizer step by a recorder of the full gradients (weights stay put)."""

    def step(*_args, **_kwargs):
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in worker.policy.named_parameters()})  # fmt: skip

    worker.optimizer.step = step


def _run(worker, per_rank: dict, full: bool) -> dict:
    """Every variant on this rank's packs; metrics and recorded gradients."""
    grads: list = []
    _record_steps(worker, grads)
    out = {"old": worker.compute_logprobs(per_rank["packs"]), "ref": worker.compute_ref_logprobs(per_rank["packs"])}
    fits = []
    for algo, with_old in _variants(full):
        worker.cfg.algo = AlgoConfig(**algo)
        old = per_rank["old"] if with_old else None
        steps = per_rank["steps"] if with_old else [len(per_rank["packs"])]
        start = len(grads)
        m = worker.fit(per_rank["packs"], steps, 0, 8, old, per_rank["ref"] if algo["use_kl_loss"] else None)
        fits.append((dataclasses.asdict(m), grads[start:]))
    start = len(grads)
    sft = worker.fit_sft(per_rank["packs"], 8)
    out["fits"], out["sft"] = fits, (dataclasses.asdict(sft), grads[start:])
    return out


def _rank_main(rank: int, world: int, cfg_json: str, model_dir: str, port: int, data: list, full: bool, out: str):
    from rlpipe.train.worker import TrainingWorker

    torch.set_num_threads(1)
    worker = TrainingWorker(cfg_json, model_dir, rank, world)
    worker.setup("127.0.0.1", port)
    try:
        torch.save(_run(worker, data[rank], full), f"{out}.{rank}")
    finally:
        worker.shutdown()


def _data(model_dir: str, cfg, n_packs: int = 4):
    """Packs whose rollout logprobs, old and reference logprobs are the model's own plus noise (so ratios,
    clipping, IS weights, vetoes and KL are all non-trivial)."""
    items = random_items(7, 10, (3, 14))
    packs = pack_sequences(items, 61, pad_token_id=0, dp_size=n_packs, balance=True)  # odd length: sp padding
    assert len(packs) == n_packs
    ref_worker = _reference_worker(cfg, model_dir)
    logprobs = ref_worker.compute_logprobs(packs)
    g = torch.Generator().manual_seed(3)

    def noisy(lp, pack, scale):
        mask = pack.shifted_labels != IGNORE_INDEX
        return torch.where(mask, lp + scale * torch.randn(lp.shape, generator=g), 0.0)

    packs = [replace(p, rollout_logprobs=noisy(lp, p, 0.3)) for p, lp in zip(packs, logprobs, strict=True)]
    old = [noisy(lp, p, 0.05) for p, lp in zip(packs, logprobs, strict=True)]
    ref = [noisy(lp, p, 0.2) for p, lp in zip(packs, logprobs, strict=True)]
    return packs, old, ref


def _reference_worker(cfg, model_dir: str):
    """The sp = 1 single-process worker, scoring with the same packed attention as the sp ranks."""
    from rlpipe.train.optim import build_optimizer

    w = in_process_worker(cfg, model_dir)
    w.policy = w._loaded_policy(model_dir, "cpu")
    w.policy.hf.config.use_cache = False
    w.policy.train()
    w.optimizer = build_optimizer(w.policy.parameters(), cfg.train)
    w.ref = w._loaded_policy(model_dir, "cpu").eval().requires_grad_(False)
    return w


def _per_rank(packs, old, ref, dp: int, sp: int) -> list[dict]:
    """What the controller sends each rank for two mini-batches of len(packs) / 2 packs (controller.fit)."""
    half = len(packs) // 2
    ranks = [{"packs": [], "old": [], "ref": [], "steps": []} for _ in range(dp * sp)]
    for mb in (slice(0, half), slice(half, None)):
        for key, values in (("packs", packs), ("old", old), ("ref", ref)):
            for r, shard in enumerate(mesh_shards(values[mb], dp, sp)):
                ranks[r][key] += shard
        for r, shard in enumerate(mesh_shards(packs[mb], dp, sp)):
            ranks[r]["steps"].append(len(shard))
    return ranks


def _assert_metrics_close(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            if k not in TIMINGS:
                _assert_metrics_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_metrics_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert math.isclose(got, want, rel_tol=2e-5, abs_tol=1e-6), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got} != {want}"


def _assert_grads_close(got: list[dict], want: list[dict], where: str) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want, strict=True):
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-4, atol=1e-6, msg=f"{where} {name}")


def _check(tmp_path, model_dir: str, world: int, sp: int, fsdp: bool, full: bool) -> None:
    from rlpipe.train.distributed import free_port

    cfg = _config(tmp_path, world, sp, fsdp, model_dir)
    base_cfg = _config(tmp_path, 1, 1, False, model_dir)
    packs, old, ref = _data(model_dir, base_cfg)
    dp = world // sp
    want = _run(_reference_worker(base_cfg, model_dir), _per_rank(packs, old, ref, 1, 1)[0], full)
    steps = [s for m, _ in want["fits"] for s in m["steps"]]
    assert any(s["clip_frac_low"] + s["clip_frac_high"] > 0 for s in steps)  # the clipped branches are exercised
    assert any(0 < m["rollout_is"].get("rollout_is_eff_sample_size", 1) < 1 for m, _ in want["fits"][:-1])
    out = str(tmp_path / "rank")
    data = _per_rank(packs, old, ref, dp, sp)
    mp.spawn(_rank_main, args=(world, cfg.model_dump_json(), model_dir, free_port(), data, full, out), nprocs=world)
    for rank in range(world):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        d = rank // sp
        for key in ("old", "ref"):  # per-token, on this rank's dp shard
            for j, lp in enumerate(got[key]):
                torch.testing.assert_close(lp, want[key][d + j * dp], rtol=1e-5, atol=1e-6)
        for i, ((gm, gg), (wm, wg)) in enumerate(zip(got["fits"], want["fits"], strict=True)):
            _assert_metrics_close(gm, wm, f"rank {rank} variant {i}")
            _assert_grads_close(gg, wg, f"rank {rank} variant {i}")
        _assert_metrics_close(got["sft"][0], want["sft"][0], f"rank {rank} sft")
        _assert_grads_close(got["sft"][1], want["sft"][1], f"rank {rank} sft")


def test_sp2_replicated_equals_sp1_for_every_loss_and_aggregation(tmp_path):
    """sp = 2 on two ranks (dp = 1, replicated layout): the Qwen2 tiny default (2 heads, 1 kv head: repeated)."""
    model_dir = create_tiny_model_dir(tmp_path / "qwen2", TinyModelConfig(), seed=0)
    _check(tmp_path, model_dir, world=2, sp=2, fsdp=False, full=True)


def test_dp2_sp2_fsdp_on_four_ranks_equals_sp1(tmp_path):
    """dp = 2 x sp = 2 on four ranks with FSDP2 over the whole mesh: a Llama with 4 heads / 2 kv heads (split)."""
    cfg = TinyModelConfig(arch="llama", num_heads=4, num_kv_heads=2)
    model_dir = create_tiny_model_dir(tmp_path / "llama", cfg, seed=1)
    _check(tmp_path, model_dir, world=4, sp=2, fsdp=True, full=False)
