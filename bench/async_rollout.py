"""Pipelined rollout (rollout.max_staleness=1) vs the synchronous loop (0) on the vLLM CPU engine, same work, one run.

Command (from the repo root; needs `bash scripts/setup_vllm.sh`, or --vllm-python pointing at a vLLM venv):

    RAY_AUTH_MODE=disabled .venv/bin/python bench/async_rollout.py

One vLLM server is started per core layout (it takes ~60-100 s here) and every run connects to it (`rollout.server_url`;
each run syncs its own weights into it from version 0). Each variant runs `--iterations` GRPO iterations of the
default task (the tiny default model, 64 prompts x 8 samples, rollout IS on in both so the work is the same), in
one process with one local Ray per layout, per seed in the order k=0, k=1 (and `--blocks 2` adds k=1, k=0: ABBA). From the metrics
rows, medians over iterations 3..K (iteration 1 of k=1 cannot overlap; 2 warms up): `iteration_time_s`, rollout
time, how long the trainer waited for a batch (`pipeline/wait_s`), the publish and the part of the sync the
trainer waits for, staleness. Rewards are compared per weight version, not per iteration: k=1 trains iteration t
on a batch sampled from the weights after t-2, k=0 after t-1, so per iteration k=1 lags one update by
construction. The mean sampled reward over the last 10 versions both runs have is compared across `--seeds`
replicates (data.seed: other problems, another prompt order): k=1 minus k=0 against 2 standard errors of the
paired differences. The curves (seed 0) go to `bench/async_rollout.png`. The load average is recorded before and after:
the machine is shared with other engineers, and the engine and the trainer share its 2 cores.

Two core layouts (``--layouts``, default both, each with its own server start):
- shared: every process may run on every core (vLLM's own OpenMP binding puts its compute thread on core 0 and
  reserves core 1 for its scheduler; the trainer's 2 Ray workers float over both).
- partitioned: the vLLM server (all its processes, ``VLLM_CPU_OMP_THREADS_BIND=0``) on core 0 only, the trainer
  (driver, Ray daemons, both workers) on core 1 only, set with ``sched_setaffinity`` before each is started. This is
  the layout a GPU deployment of the pipelined loop has: the engine and the trainer on hardware of their own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _common import finish_reward_plot, median, repo_relative, table, write_section  # noqa: E402

HEADERS = ["layout", "seed", "k", "block", "wall s/iter", "rollout s/iter", "train (fit) s/iter",
           "trainer waited s/iter", "publish s/iter", "sync (trainer waits) s/iter", "max staleness",
           "reward (last 10 versions)", "max abs mismatch_kl", "run wall s"]  # fmt: skip
COL = {name: i for i, name in enumerate(HEADERS)}


def _overrides(work: Path, k: int, iterations: int, url: str, block: int, seed: int = 0, extra=()) -> dict:
    run = work / f"k{k}-b{block}-s{seed}"
    return {
        "data.seed": seed,  # the task's problems and the prompt order: an independent replicate per seed
        "output_dir": str(work / "out"),  # one base model (and prompt file) for every run
        "checkpoint.root": str(run / "ckpt"),
        "rollout.weight_sync.dir": str(run / "serving"),
        "checkpoint.save_optimizer": False,
        "iterations": iterations,
        "segment_size": iterations,
        "rollout.engine": "vllm",
        "rollout.server_url": url,
        "algo.rollout_is.enabled": True,
        "rollout.max_staleness": k,
        **dict(extra),  # --set KEY=VALUE pairs, the same for every run
    }


def start_server(cfg, model_dir: str):
    """The CPU server `rollout.engine=vllm` would start for `cfg` (`serving.managed_server_spec`), started once."""
    from rlpipe.rollout.sources import SERVED_MODEL_NAME, managed_server_spec
    from rlpipe.rollout.vllm_process import VLLMServer

    server = VLLMServer(managed_server_spec(cfg, model_dir, SERVED_MODEL_NAME, on_gpu=False), log=print)
    start = time.perf_counter()
    server.start()
    return server, time.perf_counter() - start


def by_version(rows: list[dict]) -> dict[int, float]:
    """Sampled reward per weight version (the iteration whose weights sampled the batch): k=1 samples iteration t
    from the weights after t-2, k=0 from those after t-1, so per iteration k=1 lags one update by construction."""
    return {int(r.get("pipeline/weights_iteration", r["iteration"] - 1)): r["reward_mean"] for r in rows}


def last_versions_reward(rewards: dict[int, float], versions: list[int]) -> float:
    return statistics.fmean(rewards[v] for v in versions)


def summarize(layout: str, seed: int, k: int, block: int, rows: list[dict], wall: float) -> list[object]:
    steady = rows[2:] or rows
    rewards = by_version(rows)
    last = sorted(rewards)[-10:]
    sync = [r.get("engine/sync_blocking_time_s", r.get("engine/sync_time_s", 0.0)) for r in steady]
    return [layout, seed, k, block, median([r["iteration_time_s"] for r in steady]),
            median([r["rollout_time_s"] for r in steady]), median([r["fit_time_s"] for r in steady]),
            median([r.get("pipeline/wait_s", r["rollout_time_s"]) for r in steady]),
            median([r.get("engine/publish_time_s", 0.0) for r in steady]), median(sync),
            max(r.get("staleness", 0.0) for r in rows), last_versions_reward(rewards, last),
            max(abs(r["mismatch/mismatch_kl"]) for r in rows), wall]  # fmt: skip


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        rewards = by_version(rows)
        ax.plot(sorted(rewards), [rewards[v] for v in sorted(rewards)], label=label, alpha=0.8,
                linestyle="--" if label.startswith("partitioned") else "-")  # fmt: skip
    finish_reward_plot(fig, ax, path, "GRPO on vLLM (CPU): synchronous vs one-step-off-policy",
                       "weight version (updates before sampling)", "mean sampled reward")  # fmt: skip
    plt.close(fig)


def reward_verdict(k0: list[list[dict]], k1: list[list[dict]]) -> tuple[float, float, str]:
    """k=1 minus k=0 sampled reward over the last 10 weight versions both runs have, 2 standard errors, and what the
    error is of: with several seeds, the seed-to-seed spread of the paired differences; with one, the spread of the
    per-version rewards (it ignores run-to-run variance, so it is too tight)."""
    diffs, per_version = [], ([], [])
    for a, b in zip(k0, k1, strict=True):
        ra, rb = by_version(a), by_version(b)
        versions = sorted(set(ra) & set(rb))[-10:]
        diffs.append(last_versions_reward(rb, versions) - last_versions_reward(ra, versions))
        for side, rewards in zip(per_version, (ra, rb), strict=True):
            side.extend(rewards[v] for v in versions)
    if len(diffs) >= 2:
        return statistics.fmean(diffs), 2 * statistics.stdev(diffs) / math.sqrt(len(diffs)), f"{len(diffs)} seeds"
    se = math.sqrt(sum(statistics.variance(x) / len(x) for x in per_version))
    return diffs[0], 2 * se, "one seed: per-version spread"


def noise_verdict(diff: float, two_se: float) -> str:
    """k=1 learns as well as k=0 unless its reward is lower by more than the noise; higher is said as such."""
    if abs(diff) <= two_se + 1e-9:
        return "within the noise"
    return "k=1 higher, outside the noise" if diff > 0 else "k=1 LOWER, outside the noise"


LAYOUTS = ("shared", "partitioned")
# Which cores each side may use, per layout: (vLLM server, trainer); None leaves the affinity alone.
CORES: dict[str, tuple[set[int] | None, set[int] | None]] = {"shared": (None, None), "partitioned": ({0}, {1})}


def _pin(cores: set[int] | None, all_cores: set[int]) -> None:
    """This thread's CPU affinity, inherited by every process it starts from now on (the server, Ray)."""
    os.sched_setaffinity(0, cores if cores is not None else all_cores)


def run_layout(layout: str, order: list[int], args, work: Path, rows: list, curves: dict) -> float:
    """Start a server pinned for `layout`, run each seed and k of `order` against it, stop it; its start-up seconds."""
    import ray

    from rlpipe.base_model import prepare_base_model
    from rlpipe.config import load_config
    from rlpipe.loop import run_segment

    all_cores = os.sched_getaffinity(0)
    server_cores, trainer_cores = CORES[layout]
    work = work / layout  # the base model, the prompts and the server log of this layout's runs
    server_overrides = [("rollout.vllm.python", args.vllm_python), *args.set]
    cfg0 = load_config(overrides=_overrides(work, 0, args.iterations, "http://127.0.0.1:1", 0, 0, server_overrides))
    model_dir = prepare_base_model(cfg0)
    _pin(server_cores, all_cores)
    bind = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if server_cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(server_cores)))
    try:
        server, startup = start_server(cfg0, model_dir)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    _pin(trainer_cores, all_cores)  # before Ray starts, so its daemons and workers inherit it
    try:
        for seed in range(args.seeds):
            for block, k in enumerate(order):
                overrides = _overrides(work, k, args.iterations, server.base_url, block, seed, args.set)
                print(f"{layout}: seed {seed}, k={k} (block {block}) ...", flush=True)
                start = time.perf_counter()
                result = run_segment(load_config(overrides=overrides), None, args.iterations, log=lambda m: None)
                rows.append(summarize(layout, seed, k, block, result.metrics, time.perf_counter() - start))
                if args.save_metrics is not None:
                    save_rows(args.save_metrics / f"{layout}-s{seed}-k{k}-b{block}.jsonl", result.metrics)
                curves.setdefault((layout, k, seed), result.metrics)
                print(table(HEADERS, [rows[-1]]), flush=True)
    finally:
        ray.shutdown()  # the next layout starts a Ray of its own, with its own affinity
        server.stop()
        _pin(None, all_cores)
    return startup


def save_rows(path: Path, metrics: list[dict]) -> None:
    """One run's metrics rows as JSON lines, as `rlpipe run` writes metrics.jsonl (for per-iteration analysis:
    staleness, mismatch, IS weights); written whole or not at all."""
    from rlpipe.io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in metrics))


def layout_report(layout: str, rows: list, curves: dict, seeds: int) -> tuple[str, dict[int, float]]:
    """The speed-up, its bound and the reward verdict of one layout."""
    mine = [r for r in rows if r[COL["layout"]] == layout]
    k0, k1 = ([r for r in mine if r[COL["k"]] == k] for k in (0, 1))

    def med(part: list, name: str) -> float:
        return median([r[COL[name]] for r in part])

    per_k = {0: med(k0, "wall s/iter"), 1: med(k1, "wall s/iter")}
    speedup = per_k[0] / per_k[1]
    # The overlap's bound from the k=0 medians: sampling (rollout minus its sync) runs beside the rest of the
    # iteration plus the publish (written while the producer samples); the load and probe cannot overlap (the
    # engine must be idle): T0 / (max(sample, rest + publish) + sync - publish).
    wall0, roll0, sync0, pub0 = (med(k0, n) for n in ("wall s/iter", "rollout s/iter", "sync (trainer waits) s/iter",
                                                      "publish s/iter"))  # fmt: skip
    sample0, rest0 = roll0 - sync0, wall0 - roll0
    ideal = wall0 / (max(sample0, rest0 + pub0) + sync0 - pub0)
    slow_roll = med(k1, "rollout s/iter") / sample0  # k=1's rollout time holds no sync, k=0's does
    slow_fit = med(k1, "train (fit) s/iter") / med(k0, "train (fit) s/iter")
    diff, two_se, basis = reward_verdict(*([curves[(layout, k, s)] for s in range(seeds)] for k in (0, 1)))
    text = (
        f"**{layout}**: wall time per iteration k=0 {per_k[0]:.3g} s, k=1 {per_k[1]:.3g} s: **{speedup:.2f}x** less "
        f"at k=1 (target >= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'}). Sampled reward over the last 10 weight "
        f"versions (the same number of updates behind each batch): k=1 minus k=0 = {diff:+.3f}, 2 SE = "
        f"{two_se:.3f} ({basis}): {noise_verdict(diff, two_se)}. The bound of "
        f"the overlap from the k=0 medians: {ideal:.2f}x (sampling {sample0:.3g} s beside the rest {rest0:.3g} s + "
        f"publish {pub0:.3g} s, then load and probe {sync0 - pub0:.3g} s, which need the engine idle); side by side "
        f"at k=1, sampling took {slow_roll:.2f}x and the training forward/backward {slow_fit:.2f}x as long as when "
        "each ran alone at k=0."
    )
    return text, per_k


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30, help="GRPO iterations per variant.")
    ap.add_argument("--blocks", type=int, default=1, choices=(1, 2), help="1: k=0, k=1; 2: ABBA.")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="Comma-separated: shared, partitioned.")
    ap.add_argument("--seeds", type=int, default=3, help="data.seed replicates of each variant (reward noise).")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="A config override for every run (repeatable), e.g. train.lr=3e-4.")  # fmt: skip
    ap.add_argument("--vllm-python", default=os.environ.get("RLPIPE_VLLM_PYTHON")
                    or str(REPO / ".venv-vllm" / "bin" / "python"))  # fmt: skip
    ap.add_argument("--plot", type=Path, default=HERE / "async_rollout.png", help="PNG of the reward curves.")
    ap.add_argument("--save-metrics", type=Path, default=None, metavar="DIR",
                    help="Also write each run's metrics rows to DIR/<layout>-s<seed>-k<k>-b<block>.jsonl.")  # fmt: skip
    ap.add_argument("--no-record", action="store_true", help="Print only; do not append to bench/RESULTS.md.")
    args = ap.parse_args(argv)
    from rlpipe.config import parse_override

    args.set = [parse_override(text) for text in args.set]
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        ap.error(f"--layouts takes a comma-separated subset of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if "partitioned" in layouts and not {0, 1} <= os.sched_getaffinity(0):
        ap.error("the partitioned layout needs cores 0 and 1 in this process's CPU affinity")

    import torch

    torch.set_num_threads(1)  # the driver only judges and packs; 2 spinning threads on a loaded box cost 20x (measured)
    order = [0, 1] if args.blocks == 1 else [0, 1, 1, 0]
    load_before = os.getloadavg()
    rows, curves, startups = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="async-rollout-") as tmp:
        for layout in layouts:
            (Path(tmp) / layout).mkdir()
            startups[layout] = run_layout(layout, order, args, Path(tmp), rows, curves)
    load_after = os.getloadavg()
    plot({f"{layout}, max_staleness={k}": m for (layout, k, seed), m in curves.items() if seed == 0},
         args.plot)  # fmt: skip
    reports = {layout: layout_report(layout, rows, curves, args.seeds) for layout in layouts}
    body = table(HEADERS, rows) + "\n\n" + "\n".join(text for text, _ in reports.values()) + "\n"
    if set(layouts) == set(LAYOUTS):
        body += (
            f"Partitioned k=1 against shared k=0 (the best of the pipelined loop against today's loop on this "
            f"machine): {reports['shared'][1][0] / reports['partitioned'][1][1]:.2f}x less wall time per iteration.\n"
        )
    body += (
        f"Reward curves: `{repo_relative(args.plot)}`. vLLM server start-up "
        + ", ".join(f"{name} {secs:.0f} s" for name, secs in startups.items())
        + f". Load average (1, 5, 15 min) before {tuple(round(x, 1) for x in load_before)}, after "
        f"{tuple(round(x, 1) for x in load_after)}, on {os.cpu_count()} cores shared by the vLLM server, the "
        "trainer's Ray workers and other users' jobs.\n"
        f"Same work per variant: {args.iterations} GRPO iterations of the default task (tiny model, 64 prompts x 8 "
        f"samples x 6 tokens, 2 workers) per seed (data.seed 0..{args.seeds - 1}), rollout IS (token, truncate at 2) "
        "on in both; medians over iterations 3..K and seeds. The curves are seed 0's."
        + (f" Overrides: {', '.join(f'{key}={value}' for key, value in args.set)}." if args.set else "")
    )
    print(body)
    if not args.no_record:
        write_section("Pipelined rollout: max_staleness 1 vs 0 (vLLM CPU)", body, None, __file__, argv)


if __name__ == "__main__":
    main()
