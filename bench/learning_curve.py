"""Learning proof: run the README's default pipeline, plot reward per iteration, record the numbers.

Target (issue 6): mean reward <= 0.3 over the first iterations and >= 0.8 over the last, within 10 minutes wall time.
Run: `.venv/bin/python bench/learning_curve.py` (add `--set key=value` to try other settings).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import finish_reward_plot, table, write_section  # noqa: E402

from rlpipe.config import PipelineConfig  # noqa: E402


def run_default(workdir: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """`rlpipe run` exactly as the README does, in a scratch output directory; returns metrics rows and wall time."""
    cmd = [sys.executable, "-m", "rlpipe.cli", "run",
           "--set", f"output_dir={workdir / 'out'}", "--set", f"checkpoint.root={workdir / 'ckpt'}"]  # fmt: skip
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    wall = time.perf_counter() - start
    metrics = next((workdir / "out").glob("*/metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()], wall


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [r["reward_mean"] for r in rows]
    ax.plot(it, rewards, label="mean reward (sampled, T=1)", alpha=0.45)
    smooth = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    ax.plot(it, smooth, label="mean reward, 10-iteration running mean")
    ax.plot(it, [r["pass_at_n"] for r in rows], label="pass@n", alpha=0.5)
    ax.axhline(0.8, color="grey", ls="--", lw=0.8)
    ax.axhline(0.3, color="grey", ls=":", lw=0.8)
    finish_reward_plot(fig, ax, path, title, "RL iteration", "reward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--set", action="append", default=[], help="extra rlpipe overrides")
    parser.add_argument("--window", type=int, default=10, help="iterations averaged at the start and the end")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows, wall = run_default(Path(tmp), args.set)
    rewards = [r["reward_mean"] for r in rows]
    first = sum(rewards[: args.window]) / args.window
    last = sum(rewards[-args.window :]) / args.window
    plot(
        rows,
        HERE / "learning_curve.png",
        f"rlpipe default: tiny model, built-in {PipelineConfig().data.task} task, CPU",
    )
    met = first <= 0.3 and last >= 0.8 and wall <= 600
    measures = [
        ("iterations", str(len(rows))),
        (f"mean reward, first {args.window}", f"{first:.3f}"),
        (f"mean reward, last {args.window}", f"{last:.3f}"),
        ("wall time (incl. warm-up SFT and Ray start)", f"{wall:.0f} s"),
        ("target <=0.3 -> >=0.8 in <=600 s", "met" if met else "NOT met"),
    ]
    print("\n".join(f"{k}: {v}" for k, v in measures))
    print("rewards:", " ".join(f"{r:.2f}" for r in rewards))
    if not args.no_record:
        body = table(["measure", "value"], [list(m) for m in measures])
        body += "\n\nReward per iteration: " + " ".join(f"{r:.2f}" for r in rewards) + "\n\n![](learning_curve.png)\n"
        write_section("Learning proof (default pipeline)", body, None, __file__, None)


if __name__ == "__main__":
    main()
