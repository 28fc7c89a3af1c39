"""Data-parallel scaling: 1 vs 2 Ray training workers (gloo) on the same global batch.

Both controllers are alive at once (Ray is started with enough logical CPUs for 3 one-CPU actors) so the A/B
repeats alternate within one run: ``TrainingController.fit`` on world size 1, then 2 (order flipped every repeat),
each on the same synthetic mini-batches (packed with ``dp_size=2`` so both see identical packs). The idle
controller's actors are blocked waiting for calls and use no CPU. One fit = old-logprob forward + one optimizer step
per mini-batch. Reported: driver wall time of fit, and the sum of optimizer-step times (max over ranks).
Speedup = time(ws=1) / time(ws=2), median of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import length_mix, median, table, verdict, write_section  # noqa: E402

TARGET = 1.5  # speedup of 2 workers over 1 (ideal 2.0 on 2 free cores)
MODELS = {
    "tiny": {},
    "8m": {"hidden_size": 256, "num_layers": 8, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 1024},
}


def start_ray(num_cpus: int) -> None:
    """Local Ray with ``num_cpus`` logical CPUs (the controller's ensure_ray then reuses it)."""
    import ray

    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
                                  "TRANSFORMERS_VERBOSITY": "error"}},
    )  # fmt: skip


def make_config(root: Path, world_size: int, model: str, budget: int, steps: int):
    from rlpipe.config import load_config

    overrides = {
        "output_dir": str(root / "out"),
        "checkpoint.root": str(root / "ckpt"),
        "model.warmup_sft_steps": 0,  # speed only: an untrained policy does the same work
        "rollout.max_new_tokens": 200,
        "train.world_size": world_size,
        "train.threads_per_worker": 1,
        "train.pack_max_length": budget,
        "train.optimizer_steps": steps,
        "train.device": "cpu",
    }
    overrides.update({f"model.tiny.{k}": v for k, v in MODELS[model].items()})
    overrides.update({"model.tiny.max_position_embeddings": 256})
    return load_config(overrides=overrides)


def _layout(cfg, model_dir: str) -> str:
    """What `train.fsdp` resolves to for this model: 'FSDP2' or 'replicated'."""
    from rlpipe.models.loading import load_model
    from rlpipe.train.policy import resolve_small_model_auto

    return "FSDP2" if resolve_small_model_auto(cfg.train.fsdp, load_model(model_dir)) else "replicated"


def minibatches(batch: int, steps: int, budget: int, seed: int):
    """The same packs for both world sizes: `steps` mini-batches, each packed with dp_size=2 and balanced over the
    ranks, as the trainer packs (`RLSession._pack`)."""
    from rlpipe.data.packing import pack_sequences

    items = length_mix(batch, seed)
    per = len(items) // steps
    return [pack_sequences(items[i * per : (i + 1) * per], budget, 0, dp_size=2, pad_to_max_length=False,
                           balance=True) for i in range(steps)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternated fits per world size (median reported)")
    ap.add_argument("--quick", action="store_true", help="tiny model, small batch, 1 repeat (smoke test)")
    ap.add_argument("--model", choices=sorted(MODELS), default="8m")
    ap.add_argument("--batch", type=int, default=128, help="sequences per RL iteration (global)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (mini-batches) per fit")
    ap.add_argument("--budget", type=int, default=1024, help="train.pack_max_length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default bench/RESULTS.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.steps, args.repeats = "tiny", 16, 1, 1
    import ray
    import torch

    from rlpipe.base_model import prepare_base_model
    from rlpipe.train.controller import TrainingController

    torch.set_num_threads(1)
    start_ray(num_cpus=3)
    controllers: dict[int, TrainingController] = {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as tmp:
        try:
            cfgs = {ws: make_config(Path(tmp), ws, args.model, args.budget, args.steps) for ws in (1, 2)}
            model_dir = prepare_base_model(cfgs[1], log=lambda *a, **k: None)
            for ws in (1, 2):
                controllers[ws] = TrainingController(cfgs[ws], model_dir)
            mbs = minibatches(args.batch, args.steps, args.budget, args.seed)
            real_tokens = sum(p.num_tokens for mb in mbs for p in mb)
            layout = _layout(cfgs[2], model_dir)
            for ws in (1, 2):  # warm-up fit outside the timing
                controllers[ws].fit(mbs, 0, 1000)
            wall: dict[int, list[float]] = {1: [], 2: []}
            step: dict[int, list[float]] = {1: [], 2: []}
            for r in range(args.repeats):
                for ws in (1, 2) if r % 2 == 0 else (2, 1):
                    t0 = time.perf_counter()
                    metrics = controllers[ws].fit(mbs, r + 1, 1000)
                    wall[ws].append(time.perf_counter() - t0)
                    step[ws].append(sum(s.step_time_s for s in metrics.steps))
        finally:
            for c in controllers.values():
                c.shutdown()
            ray.shutdown()
    speedup = median([a / b for a, b in zip(wall[1], wall[2], strict=True)])
    step_speedup = median([a / b for a, b in zip(step[1], step[2], strict=True)])
    print(f"scaling ratio: fit time ws=1 / ws=2 = {speedup:.2f}x (optimizer steps {step_speedup:.2f}x; "
          f"target >= {TARGET}x)")  # fmt: skip
    rows = [[ws, median(wall[ws]), median(step[ws]), real_tokens / median(wall[ws])] for ws in (1, 2)]
    body = (
        f"Model `{args.model}` ({MODELS[args.model] or 'TinyModelConfig defaults'}), global batch {args.batch} "
        f"sequences (length mix of bench/packing.py, {real_tokens} real tokens), {args.steps} optimizer steps per "
        f"fit, pack budget {args.budget}, train.threads_per_worker=1, gloo, train.fsdp={cfgs[2].train.fsdp} "
        f"({layout} at world size 2), "
        f"{args.repeats} alternated repeats.\n\n"
        + table(["world size", "fit wall (s)", "optimizer steps (s)", "real tok/s (fit)"], rows)
        + f"\n\nSpeedup ws=1 / ws=2: fit {speedup:.2f}x, optimizer steps {step_speedup:.2f}x; target >= {TARGET}x "
        f"(fit): {verdict(speedup >= TARGET)}.\n"
    )
    write_section("Scaling: 1 vs 2 Ray training workers", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
