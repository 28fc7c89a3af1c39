"""Pipelined rollout (rollout.max_staleness=1) vs the synchronous loop (0) on the vLLM CPU engine, same work, one run.

Command (from the repo root; needs `bash scripts/setup_vllm.sh`, or --vllm-python pointing at a vLLM venv):

    RAY_AUTH_MODE=disabled .venv/bin/python bench/async_rollout.py

One vLLM server is started once (it takes ~60-100 s here) and both variants connect to it (`rollout.server_url`;
each run syncs its own weights into it from version 0). Each variant runs `--iterations` GRPO iterations of the
default task (the tiny default model, 64 prompts x 8 samples, rollout IS on in both so the work is the same), in
one process with one local Ray, in the order k=0, k=1 (and `--blocks 2` adds k=1, k=0: ABBA). From the metrics
rows, medians over iterations 3..K (iteration 1 of k=1 cannot overlap; 2 warms up): `iteration_time_s`, rollout
time, how long the trainer waited for a batch (`pipeline/wait_s`), the sync time, staleness; the reward curves of
both go to `bench/async_rollout.png`, and the mean reward of the last 10 iterations of each is compared against
the noise (2 standard errors of the difference of the two means). The load average is recorded before and after:
the machine is shared with other engineers, and the engine and the trainer share its 2 cores.
"""

from __future__ import annotations

import argparse
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
from _common import finish_reward_plot, median, table, write_section  # noqa: E402

HEADERS = ["k", "block", "wall s/iter", "rollout s/iter", "train (fit) s/iter", "trainer waited s/iter",
           "sync s/iter", "max staleness", "reward (last 10)", "max abs mismatch_kl", "run wall s"]  # fmt: skip


def _overrides(work: Path, k: int, iterations: int, url: str, block: int) -> dict:
    run = work / f"k{k}-b{block}"
    return {
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
    }


def start_server(cfg, model_dir: str, vllm_python: str, log_dir: Path):
    from rlpipe.rollout.vllm_server import VLLMServer, VLLMServerSpec, check_cpu_head_dim

    check_cpu_head_dim(model_dir)
    spec = VLLMServerSpec(python=vllm_python, model_dir=str(Path(model_dir).resolve()), served_model_name="policy",
                          max_model_len=cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
                          kv_cache_gib=cfg.rollout.vllm.kv_cache_gib, log_path=str(log_dir / "vllm.log"))  # fmt: skip
    server = VLLMServer(spec, log=print)
    start = time.perf_counter()
    server.start()
    return server, time.perf_counter() - start


def summarize(k: int, block: int, rows: list[dict], wall: float) -> list[object]:
    steady = rows[2:] or rows
    last = [r["reward_mean"] for r in rows[-10:]]
    return [k, block, median([r["iteration_time_s"] for r in steady]), median([r["rollout_time_s"] for r in steady]),
            median([r["fit_time_s"] for r in steady]), median([r.get("pipeline/wait_s", r["rollout_time_s"]) for r in steady]),
            median([r.get("engine/sync_time_s", 0.0) for r in steady]),
            max(r.get("staleness", 0.0) for r in rows), statistics.fmean(last),
            max(abs(r["mismatch/mismatch_kl"]) for r in rows), wall]  # fmt: skip


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in curves.items():
        ax.plot([r["iteration"] for r in rows], [r["reward_mean"] for r in rows], label=label, alpha=0.8)
    finish_reward_plot(fig, ax, path, "GRPO on vLLM (CPU): synchronous vs one-step-off-policy",
                       "RL iteration", "mean sampled reward")  # fmt: skip
    plt.close(fig)


def reward_verdict(a: list[float], b: list[float]) -> tuple[float, bool]:
    """Difference of mean rewards and whether it is within 2 standard errors (independent samples)."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    diff = statistics.fmean(b) - statistics.fmean(a)
    return diff, abs(diff) <= 2 * se + 1e-9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30, help="GRPO iterations per variant.")
    ap.add_argument("--blocks", type=int, default=1, choices=(1, 2), help="1: k=0, k=1; 2: ABBA.")
    ap.add_argument("--vllm-python", default=os.environ.get("RLPIPE_VLLM_PYTHON")
                    or str(REPO / ".venv-vllm" / "bin" / "python"))  # fmt: skip
    ap.add_argument("--no-record", action="store_true", help="Print only; do not append to bench/RESULTS.md.")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # the driver only judges and packs; 2 spinning threads on a loaded box cost 20x (measured)
    from rlpipe.base_model import prepare_base_model
    from rlpipe.config import load_config
    from rlpipe.pipeline import run_segment

    order = [0, 1] if args.blocks == 1 else [0, 1, 1, 0]
    load_before = os.getloadavg()
    rows, curves = [], {}
    with tempfile.TemporaryDirectory(prefix="async-rollout-") as tmp:
        work = Path(tmp)
        cfg0 = load_config(overrides=_overrides(work, 0, args.iterations, "http://127.0.0.1:1", 0))
        model_dir = prepare_base_model(cfg0)
        server, startup = start_server(cfg0, model_dir, args.vllm_python, work)
        try:
            for block, k in enumerate(order):
                cfg = load_config(overrides=_overrides(work, k, args.iterations, server.base_url, block))
                print(f"k={k} (block {block}) ...", flush=True)
                start = time.perf_counter()
                result = run_segment(cfg, None, args.iterations, log=lambda m: None)
                rows.append(summarize(k, block, result.metrics, time.perf_counter() - start))
                curves.setdefault(f"max_staleness={k}", result.metrics)
                print(table(HEADERS, [rows[-1]]), flush=True)
        finally:
            server.stop()
    load_after = os.getloadavg()
    per_k = {k: median([r[2] for r in rows if r[0] == k]) for k in (0, 1)}
    speedup = per_k[0] / per_k[1]
    # The overlap's bound from the k=0 rows: sampling (rollout minus its sync) and the rest of the iteration run side
    # by side, the sync cannot overlap (the producer waits for the new weights): T0 / (max(sample, rest) + sync).
    k0 = [r for r in rows if r[0] == 0]
    wall0, roll0, sync0 = (median([r[i] for r in k0]) for i in (2, 3, 6))
    ideal = wall0 / (max(roll0 - sync0, wall0 - roll0) + sync0)
    k1 = [r for r in rows if r[0] == 1]
    slow_roll = median([r[3] for r in k1]) / (roll0 - sync0)  # k=1's rollout time holds no sync, k=0's does
    slow_fit = median([r[4] for r in k1]) / median([r[4] for r in k0])
    diff, within = reward_verdict(*[[r["reward_mean"] for r in curves[f"max_staleness={k}"][-10:]] for k in (0, 1)])
    plot(curves, HERE / "async_rollout.png")
    body = table(HEADERS, rows) + (
        f"\n\nwall time per iteration: k=0 {per_k[0]:.3g} s, k=1 {per_k[1]:.3g} s: **{speedup:.2f}x** less at k=1 "
        f"(target >= 1.3x: {'met' if speedup >= 1.3 else 'NOT met'}). Reward, mean of the last 10 iterations: "
        f"k=1 minus k=0 = {diff:+.3f} ({'within' if within else 'OUTSIDE'} 2 standard errors). Reward curves: "
        f"`bench/async_rollout.png`.\nWhat bounds it: with free cores the overlap could give at most {ideal:.2f}x "
        f"(k=0 medians: sampling {roll0 - sync0:.3g} s and the rest {wall0 - roll0:.3g} s side by side, plus the "
        f"{sync0:.3g} s sync, which cannot overlap); running side by side on the same 2 cores, sampling took "
        f"{slow_roll:.2f}x and the training forward/backward {slow_fit:.2f}x as long as when each ran alone.\nvLLM server start-up {startup:.0f} s (once, shared). Load average (1, 5, 15 min) "
        f"before {tuple(round(x, 1) for x in load_before)}, after {tuple(round(x, 1) for x in load_after)}, on "
        f"{os.cpu_count()} cores shared by the vLLM server, the trainer's Ray workers and other users' jobs.\n"
        f"Same work per variant: {args.iterations} GRPO iterations of the default task (tiny model, 64 prompts x 8 "
        "samples x 6 tokens, 2 workers), rollout IS (token, truncate at 2) on in both; medians over iterations 3..K."
    )
    print(body)
    if not args.no_record:
        write_section("Pipelined rollout: max_staleness 1 vs 0 (vLLM CPU)", body, None, __file__, argv)


if __name__ == "__main__":
    main()
