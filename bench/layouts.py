"""Training layouts: the default pipeline's RL step replicated (`train.fsdp=false`) vs sharded with FSDP2.

Why: `train.fsdp=auto` (the default) replicates policies under 1 GiB of parameters and shards larger ones; this
measures what that choice is worth on the default run. Each variant is `rlpipe run` with the default config plus the
variant's overrides, in a fresh process, timed exactly as `trl_peer.py` times rlpipe (interval between consecutive
metrics.jsonl rows, first 2 steps excluded), variants alternated in rotating order over `--repeats`.

- replicated: every rank holds the whole policy and AdamW state; one flat gradient all-reduce per optimizer step;
- fsdp2: FSDP2 units per decoder layer + root, gathered weights kept from forward to backward (the `auto` reshard
  setting for models under 1 GiB);
- fsdp2-reshard: as fsdp2 with `fsdp_reshard_after_forward=true` (ZeRO-3: gathered again in backward).

Run (from the repo root; ~4 minutes on 2 idle cores): `.venv/bin/python bench/layouts.py`
Smoke: `.venv/bin/python bench/layouts.py --quick --no-record`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import median, table, write_section  # noqa: E402
from trl_peer import SKIP, bench_config, run_rlpipe, summarize  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "replicated": ["train.fsdp=false"],
    "fsdp2": ["train.fsdp=true", "train.fsdp_reshard_after_forward=false"],
    "fsdp2-reshard": ["train.fsdp=true", "train.fsdp_reshard_after_forward=true"],
}
BASELINE = "replicated"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant, order rotated (medians reported)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every variant")
    ap.add_argument("--quick", action="store_true", help="4 steps, 1 repeat (smoke test)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default RESULTS.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = SKIP + 2, 1
    if args.steps < SKIP + 2:
        ap.error(f"--steps must be at least {SKIP + 2} (the first {SKIP} are warm-up)")
    from rlpipe.base_model import prepare_base_model

    names = list(VARIANTS)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="rlpipe-layouts-") as tmp:
        root = Path(tmp)
        cfg = bench_config(root, args.steps, args.set)
        prepare_base_model(cfg, log=lambda *a, **k: None)  # built once, outside every timing
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                t0 = time.perf_counter()
                run = summarize(run_rlpipe(root, args.steps, len(names) * rep + names.index(name),
                                           args.set + VARIANTS[name]))  # fmt: skip
                runs[name].append(run)
                print(f"{name:14s} repeat {rep}: wall/step {run['wall']:.4f} s, train {run['train']:.4f} s, "
                      f"rollout {run['rollout']:.4f} s ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    speedups = {name: median([b["wall"] / r["wall"] for b, r in zip(runs[BASELINE], runs[name], strict=True)])
                for name in names}  # fmt: skip
    for name in names:
        print(f"{name}: wall/step {median([r['wall'] for r in runs[name]]):.4f} s; "
              f"{BASELINE} is {1 / speedups[name]:.2f}x as fast")  # fmt: skip
    if args.no_record:
        return 0
    rows = [
        [
            name,
            " ".join(VARIANTS[name]),
            *(median([r[k] for r in runs[name]]) for k in ("wall", "train", "rollout")),
            1 / speedups[name],
        ]  # fmt: skip
        for name in names
    ]
    body = (
        f"Default pipeline (`rlpipe run`, {cfg.train.world_size} Ray workers x {cfg.train.threads_per_worker} "
        f"thread, gloo, tiny default model), {args.steps} RL steps per run, first {SKIP} excluded, {args.repeats} "
        f"runs per variant in rotating order; medians. Overrides for all: {args.set or 'none'}.\n\n"
        + table(["variant", "overrides", "wall/step (s)", "train (s)", "rollout (s)", f"{BASELINE} speedup"], rows)
        + f"\n\n`{BASELINE} speedup` = median over repeats of this variant's wall per step / {BASELINE}'s.\n"
    )
    write_section("Training layouts: replicated vs FSDP2", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
