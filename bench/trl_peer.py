"""rlpipe vs TRL's GRPOTrainer (trl 1.16) on CPU at equal work: time per RL step, tokens/s, reward curves.

What is compared: `rlpipe run` with its defaults (2 Ray workers x 1 torch thread, FSDP2 over gloo, packed
sequences, shared prompts, HF generate inside the workers) against `trl.GRPOTrainer` in one process with 2 torch threads (the same
2 cores), both training the same model for the same number of updates.

How equal work is ensured: both sides read their settings from one `PipelineConfig` (rlpipe's defaults):
- model: the warm-started tiny default that `rlpipe.base_model.prepare_base_model` builds (one directory, loaded
  by both), float32, sdpa attention, no gradient checkpointing (TRL's default is on: turned off);
- task and data: `make_task_rows(data.task, data.num_prompts, data.seed)` (the rows rlpipe writes to parquet),
  chat-templated prompts; the script asserts TRL's prompt token ids equal rlpipe's `render_prompt` ids;
- reward: rlpipe's own judge (`rollout.judge`, `auto` -> `builtin` exact match) applied to
  `tokenizer.decode(completion_ids, skip_special_tokens=True)`, the same call on the same ids (response cut after
  the first EOS, EOS kept) as rlpipe's rollout;
- per step: `rollout.prompts_per_step` prompts x `rollout.n` samples, `max_new_tokens`, temperature/top-p/top-k;
  GRPO advantage with std scaling (TRL `scale_rewards="group"`), no KL (`beta=0`), token-mean loss over the whole
  batch (TRL `loss_type="dapo"`: sum over the generation batch / its number of completion tokens = rlpipe
  `token-mean`), clip 0.2/0.28, one optimizer step per generation batch (`num_iterations=1`,
  `steps_per_generation = gradient_accumulation_steps`);
- optimizer: AdamW(lr, betas, eps 1e-8, weight decay) with rlpipe's own LR multiplier (`lr_multiplier`: linear
  warm-up (step+1)/warmup_steps, then constant) passed to TRL as a LambdaLR, grad clip `train.grad_clip`;
- no vLLM, CPU only, fp32, no reporting, no checkpoints in TRL (rlpipe writes one after its last iteration, outside
  every timed window).

Timing (first 2 steps of each run excluded as warm-up, start-up excluded): "wall per step" is the interval between
the ends of consecutive RL steps (rlpipe: arrival of consecutive metrics.jsonl rows, polled every 10 ms; TRL:
consecutive `on_step_end` callbacks), i.e. everything the loop does; "step time" is rollout + fit from rlpipe's
metrics (`rollout_time_s + fit_time_s`) and `on_step_begin` -> `on_step_end` in TRL; "rollout" is rlpipe's
`rollout_time_s` and TRL's `_generate_and_score_completions`. Tokens per step = real prompt + response tokens of the
step's sequences (no padding; response tokens include the EOS), counted from the ids on both sides; tokens/s =
tokens / wall per step. rlpipe speedup = TRL wall per step / rlpipe wall per step (median of per-repeat ratios, runs
alternated rlpipe, TRL, rlpipe, ...). Target (issue 6 item 5): >= 1.5x.

Run (from the repo root; ~6 minutes on 2 idle cores with the defaults, --steps 80 --repeats 3):
    .venv/bin/python bench/trl_peer.py
Smoke: `.venv/bin/python bench/trl_peer.py --steps 4 --repeats 1 --no-record` (`--plot FILE` to also draw it).
`--set KEY=VALUE` changes the shared config of both sides (e.g. `--set train.world_size=1`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import finish_reward_plot, median, table, verdict, write_section  # noqa: E402

TARGET = 1.5  # rlpipe speedup over TRL at equal work (issue 6 item 5)
SKIP = 2  # warm-up steps excluded from every timing, on both sides
PLOT = HERE / "trl_vs_rlpipe.png"
TRL_LOSS_TYPE = "dapo"  # token-mean over the whole generation batch == rlpipe algo.loss_agg "token-mean"

DIFFERENCES = [
    "prompt computation: rlpipe computes each prompt once for its n samples, in rollout (one prefill, KV cache "
    "repeated n times) and in training (shared-prompt packs, `train.share_prompts`); TRL prefills and trains on every "
    "sample's full prompt. Same samples and the same gradients to float rounding (tested); this is most of the "
    "difference here, where prompts (9 tokens) are longer than responses (~2.6 tokens)",
    "old logprobs: on-policy (one optimizer step per generation batch) both sides take them from the training "
    "forward (rlpipe `train.old_logprobs=auto`); rlpipe also keeps the rollout logprobs (log_softmax of the generate "
    "logits) for its mismatch metrics, TRL does not",
    "layout: rlpipe packs sequences (no padding, pack_max_length tokens per micro-batch, data-parallel ranks); TRL "
    "left-pads prompts and right-pads completions into one [B, P+C] batch per micro-batch; token counts here are "
    "real prompt + response tokens per sample on both sides (a shared prompt counts once per sample)",
    "parallelism: rlpipe as configured (default 2 Ray worker processes x 1 torch thread, FSDP2 over gloo, each "
    "generating and training on half the prompts); TRL 1 process x 2 torch threads",
    "advantage epsilon: (r - mean) / (std + 1e-8) in rlpipe, + 1e-4 in TRL (both unbiased group std); with binary "
    "rewards in groups of 8 a non-zero std is >= 0.35, so advantages differ by < 3e-4 relative",
    "policy loss: rlpipe's vanilla loss has a dual clip (c=3) that TRL lacks; on-policy the ratio is 1, so neither "
    "clip acts",
    "prompt order: both draw from the same prompt rows with seed 0, but rlpipe's EpochSampler and TRL's "
    "RepeatSampler shuffle differently, and sampling RNG streams differ: reward curves agree only up to sampling "
    "noise, and response lengths (so tokens per step) differ slightly",
    "TRL computes per-token entropies in every training forward (for its logs); rlpipe computes its entropy metric "
    "from the logprobs it already has",
]


# ---------------------------------------------------------------------------------------------- shared settings


def bench_config(root: Path, steps: int, extra: list[str]):
    """rlpipe's defaults (plus `extra` KEY=VALUE overrides), scratch paths, `steps` iterations in one segment, CPU."""
    from rlpipe.config import load_config, parse_override

    return load_config(overrides={**_overrides(root, steps), **dict(parse_override(o) for o in extra)})


def _overrides(root: Path, steps: int) -> dict:
    return {
        "output_dir": str(root / "out"),
        "checkpoint.root": str(root / "ckpt"),
        "iterations": steps,
        "segment_size": steps,
        "train.device": "cpu",
    }


def _quiet(*_a, **_k) -> None:
    pass


# ---------------------------------------------------------------------------------------------- rlpipe side


def run_rlpipe(root: Path, steps: int, rep: int, extra: list[str]) -> dict:
    """`python -m rlpipe.cli run` in a subprocess; per-step rows plus the time each row reached metrics.jsonl."""
    metrics = root / f"rlpipe-r{rep}.jsonl"
    log = root / f"rlpipe-r{rep}.log"
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", "--metrics", str(metrics),
           "--set", f"experiment=trl-peer-r{rep}"]  # fmt: skip
    for key, value in _overrides(root, steps).items():
        cmd += ["--set", f"{key}={value}"]
    for o in extra:
        cmd += ["--set", o]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    arrivals: list[float] = []
    seen = 0
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                now = time.perf_counter()
                count = metrics.read_bytes().count(b"\n")
                arrivals += [now] * (count - seen)
                seen = count
            if done:
                break
            time.sleep(0.01)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"rlpipe run failed (rc={proc.returncode}); last lines of {log}:\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_out = []
    for row, t_end in zip(rows, arrivals, strict=True):
        fit = row["fit_time_s"]
        steps_out.append(
            {
                "end_t": t_end,
                "step_s": row["rollout_time_s"] + fit,
                "rollout_s": row["rollout_time_s"],
                "total_tokens": round(row["train_tokens_per_s"] * fit),  # FitMetrics.total_tokens (prompt+response)
                "response_tokens": round(row["tokens"]),  # label tokens = response tokens incl. EOS
                "reward": row["reward_mean"],
                "response_length": row["response_length_mean"],
                "truncated": row["truncated_fraction"],
                "lr": row["lr"],
            }
        )
    return {"steps": steps_out, "startup_s": (arrivals[0] - start) if arrivals else float("nan")}


# ---------------------------------------------------------------------------------------------- TRL side


def run_trl(root: Path, steps: int, rep: int, threads: int, micro_batch: int, extra: list[str]) -> dict:
    """This script's `--trl-worker` mode in a fresh process (as rlpipe gets one); returns its JSON."""
    out = root / f"trl-r{rep}.json"
    log = root / f"trl-r{rep}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(out), "--root", str(root),
           "--steps", str(steps), "--rep", str(rep), "--trl-threads", str(threads),
           "--trl-micro-batch", str(micro_batch)]  # fmt: skip
    for o in extra:
        cmd += ["--set", o]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    with log.open("w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"TRL run failed (rc={rc}); last lines of {log}:\n{tail}")
    return json.loads(out.read_text())


BENCH_EXTRA_MODULES = ("datasets", "trl")  # what the `bench` extra brings that the TRL side imports


def require_bench_extra() -> None:
    """Fail with the install command, not `No module named 'datasets'` from inside a TRL worker's log."""
    import importlib.util

    missing = [m for m in BENCH_EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f'bench/trl_peer.py needs the `bench` extra (missing: {", ".join(missing)}): pip install -e ".[bench]"'
        )


def trl_worker(out: Path, root: Path, steps: int, rep: int, threads: int, micro_batch: int, extra: list[str]) -> None:
    """One TRL GRPOTrainer run with rlpipe's settings; writes per-step timings, rewards and token counts."""
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlpipe.base_model import prepare_base_model
    from rlpipe.data.builtin_tasks import make_task_rows
    from rlpipe.data.datasets import render_prompt
    from rlpipe.rollout.judges import get_judge
    from rlpipe.train.optim import lr_multiplier

    cfg = bench_config(root, steps, extra)
    r, t, a = cfg.rollout, cfg.train, cfg.algo
    model_dir = prepare_base_model(cfg, log=_quiet)  # built by the driver already: returns the cached directory
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=cfg.model.attn_implementation
    )
    rows = make_task_rows(cfg.data.task, cfg.data.num_prompts, cfg.data.seed)
    rlpipe_ids = {
        json.dumps(row["prompt"]): render_prompt(
            row["prompt"], tokenizer, apply_chat_template=True, file="<bench>", row=i, field="prompt"
        )[0]
        for i, row in enumerate(rows)
    }
    dataset = Dataset.from_list(
        [{"prompt": row["prompt"], "ground_truth": row["ground_truth"], "data_source": row["data_source"]}
         for row in rows]
    )  # fmt: skip
    judge = get_judge(r.judge)
    record: dict[str, list] = {k: [] for k in ("reward", "prompt_tokens", "response_tokens", "response_length",
                                               "truncated", "rollout_s", "step_s", "end_t", "logged_reward",
                                               "lr")}  # fmt: skip

    def reward_fn(prompts, completions, completion_ids, ground_truth, data_source, **_):
        """rlpipe's judge on the same decode of the same ids rlpipe scores (response incl. EOS, specials skipped)."""
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        scores = [
            float(judge(ds, text, gt, None)) for ds, text, gt in zip(data_source, texts, ground_truth, strict=True)
        ]
        record["reward"].append(statistics.fmean(scores))
        return scores

    class Trainer(GRPOTrainer):
        def _generate(self, prompts):
            result = super()._generate(prompts)
            prompt_ids, completion_ids = result[0], result[1]
            for p, ids in zip(prompts, prompt_ids, strict=True):
                if list(ids) != rlpipe_ids[json.dumps(p)]:
                    raise SystemExit(f"TRL prompt ids differ from rlpipe's for {p!r}: {list(ids)}")
            eos = tokenizer.eos_token_id
            record["prompt_tokens"].append(sum(len(ids) for ids in prompt_ids))
            record["response_tokens"].append(sum(len(ids) for ids in completion_ids))
            record["response_length"].append(statistics.fmean(len(ids) for ids in completion_ids))
            record["truncated"].append(statistics.fmean(float(not ids or ids[-1] != eos) for ids in completion_ids))
            return result

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            record["rollout_s"].append(time.perf_counter() - t0)
            return output

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            record["step_s"].append(now - self.t0)
            record["end_t"].append(now)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                record["logged_reward"].append(float(logs["reward"]))
                record["lr"].append(float(logs["learning_rate"]))

    group = r.prompts_per_step * r.n  # sequences per RL step (one generation batch)
    if group % micro_batch:
        raise SystemExit(f"--trl-micro-batch {micro_batch} must divide prompts_per_step*n = {group}")
    accum = group // micro_batch
    args = GRPOConfig(
        output_dir=str(root / f"trl-out-r{rep}"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=t.seed,
        max_steps=steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,  # one generation batch = one optimizer step
        num_iterations=1,
        num_generations=r.n,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        beta=0.0 if not a.use_kl_loss else a.kl_coef,
        loss_type=TRL_LOSS_TYPE,
        scale_rewards="group",
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        mask_truncated_completions=False,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        max_grad_norm=t.grad_clip,
        activation_checkpointing=False,  # TRL's default is on; rlpipe has none
        dataloader_num_workers=0,
        use_vllm=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                                  eps=1e-8, foreach=False)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, t.lr_schedule, t.warmup_steps, cfg.iterations, t.min_lr_ratio)
    )
    trainer = Trainer(
        model=model,
        reward_funcs=[reward_fn],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
        optimizers=(optimizer, scheduler),
    )
    startup = time.perf_counter() - t_start
    trainer.train()
    n = len(record["step_s"])
    if not n == len(record["reward"]) == len(record["rollout_s"]) == len(record["prompt_tokens"]) == steps:
        raise SystemExit(f"TRL: expected {steps} steps, recorded { {k: len(v) for k, v in record.items()} }")
    steps_out = [
        {
            "end_t": record["end_t"][i],
            "step_s": record["step_s"][i],
            "rollout_s": record["rollout_s"][i],
            "total_tokens": record["prompt_tokens"][i] + record["response_tokens"][i],
            "response_tokens": record["response_tokens"][i],
            "reward": record["reward"][i],
            "response_length": record["response_length"][i],
            "truncated": record["truncated"][i],
            "lr": record["lr"][i] if i < len(record["lr"]) else float("nan"),
        }
        for i in range(n)
    ]
    result = {
        "steps": steps_out,
        "startup_s": startup,
        "logged_reward": record["logged_reward"],
        "micro_batch": micro_batch,
        "gradient_accumulation_steps": accum,
        "threads": torch.get_num_threads(),
        "activation_checkpointing": bool(trainer.model.is_activation_checkpointing),
    }
    out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- summary


def summarize(run: dict) -> dict[str, float]:
    """Means over the timed steps (all but the first SKIP) of one run."""
    steps = run["steps"]
    timed = steps[SKIP:]
    k = len(timed)
    wall = (steps[-1]["end_t"] - steps[SKIP - 1]["end_t"]) / k
    tokens = statistics.fmean(s["total_tokens"] for s in timed)
    response = statistics.fmean(s["response_tokens"] for s in timed)
    step = statistics.fmean(s["step_s"] for s in timed)
    rollout = statistics.fmean(s["rollout_s"] for s in timed)
    return {
        "wall": wall,
        "step": step,
        "rollout": rollout,
        "train": step - rollout,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "resp_tok_s": response / wall,
        "tok_s_step": tokens / step,
        "resp_len": statistics.fmean(s["response_length"] for s in timed),
        "startup": run["startup_s"],
    }


def reward_curve(runs: list[dict]) -> list[float]:
    """Median reward per step across repeats."""
    return [median([run["steps"][i]["reward"] for run in runs]) for i in range(len(runs[0]["steps"]))]


def plot(curves: dict[str, list[list[float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(curves.items(), ("tab:blue", "tab:orange"), strict=False):
        steps = range(1, len(runs[0]) + 1)
        for rewards in runs:
            ax.plot(steps, rewards, color=color, alpha=0.25, lw=0.8)
        med = [median([run[i] for run in runs]) for i in range(len(runs[0]))]
        ax.plot(steps, med, color=color, lw=1.8, label=f"{name} (median of {len(runs)} runs)")
    finish_reward_plot(fig, ax, path, title, "RL step (optimizer update)", "mean sampled reward (T=1)")


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="RL steps (optimizer updates) per run, both sides")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side, alternated rlpipe/TRL (medians reported)")
    ap.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    ap.add_argument("--trl-micro-batch", type=int, default=None,
                    help="TRL per_device_train_batch_size (default: the whole step, prompts_per_step*n; "
                         "gradient_accumulation_steps = steps_per_generation = step / micro-batch)")  # fmt: skip
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="rlpipe config override, applied to both sides' settings (e.g. train.fsdp=false)",
    )
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md or plot")
    ap.add_argument("--plot", type=Path, default=None, help=f"plot file (default {PLOT.name} when recording)")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default RESULTS.md)")
    ap.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < SKIP + 1:
        ap.error(f"--steps must be at least {SKIP + 1} (the first {SKIP} are warm-up)")

    require_bench_extra()
    if args.trl_worker is not None:
        trl_worker(args.trl_worker, args.root, args.steps, args.rep, args.trl_threads, args.trl_micro_batch, args.set)
        return 0

    from rlpipe.base_model import prepare_base_model

    with tempfile.TemporaryDirectory(prefix="rlpipe-trl-peer-") as tmp:
        root = Path(tmp)
        cfg = bench_config(root, args.steps, args.set)
        micro = args.trl_micro_batch or cfg.rollout.prompts_per_step * cfg.rollout.n
        t0 = time.perf_counter()
        prepare_base_model(cfg, log=_quiet)  # the warm-started tiny model, built once, outside every timing
        print(f"base model ready in {time.perf_counter() - t0:.0f}s", flush=True)
        runs: dict[str, list[dict]] = {"rlpipe": [], "TRL": []}
        for rep in range(args.repeats):
            for side in ("rlpipe", "TRL") if rep % 2 == 0 else ("TRL", "rlpipe"):
                t0 = time.perf_counter()
                if side == "rlpipe":
                    run = run_rlpipe(root, args.steps, rep, args.set)
                else:
                    run = run_trl(root, args.steps, rep, args.trl_threads, micro, args.set)
                runs[side].append(run)
                s = summarize(run)
                print(f"repeat {rep + 1}/{args.repeats} {side}: wall/step {s['wall']:.3f}s, step {s['step']:.3f}s "
                      f"(rollout {s['rollout']:.3f}s), {s['tok_s']:.0f} tok/s, "
                      f"run {time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    report(args, cfg, runs, micro, argv)
    return 0


def report(args, cfg, runs: dict[str, list[dict]], micro: int, argv: list[str] | None) -> None:
    sums = {side: [summarize(run) for run in rs] for side, rs in runs.items()}
    med = {side: {k: median([s[k] for s in ss]) for k in ss[0]} for side, ss in sums.items()}
    pairs = list(zip(sums["rlpipe"], sums["TRL"], strict=True))
    speed_wall = median([t["wall"] / p["wall"] for p, t in pairs])
    speed_step = median([t["step"] / p["step"] for p, t in pairs])
    speed_tok = median([p["tok_s"] / t["tok_s"] for p, t in pairs])
    speed_roll = median([t["rollout"] / p["rollout"] for p, t in pairs])
    speed_train = median([t["train"] / p["train"] for p, t in pairs])
    curves = {side: [[s["reward"] for s in run["steps"]] for run in rs] for side, rs in runs.items()}
    rew = {side: reward_curve(rs) for side, rs in runs.items()}
    w = min(5, args.steps)
    first = {side: statistics.fmean(c[:w]) for side, c in rew.items()}
    last = {side: statistics.fmean(c[-w:]) for side, c in rew.items()}
    checks = equality_checks(runs)

    print(f"rlpipe vs TRL speedup (wall per step, TRL/rlpipe): {speed_wall:.2f}x (step time {speed_step:.2f}x, "
          f"tokens/s {speed_tok:.2f}x, rollout {speed_roll:.2f}x, train {speed_train:.2f}x); target >= {TARGET}x")  # fmt: skip
    headers = ["side", "wall/step (s)", "step time (s)", "rollout (s)", "train (s)", "tokens/step",
               "tok/s (wall)", "response tok/s (wall)", "tok/s (step time)", "response len",
               f"reward first {w}", f"reward last {w}", "start-up (s)"]  # fmt: skip
    rows = [
        [side, m["wall"], m["step"], m["rollout"], m["train"], m["tokens"], m["tok_s"], m["resp_tok_s"],
         m["tok_s_step"], m["resp_len"], first[side], last[side], m["startup"]]
        for side, m in med.items()
    ]  # fmt: skip
    print(table(headers, rows))
    for side in rew:
        print(f"reward per step, {side} (median of repeats):", " ".join(f"{x:.2f}" for x in rew[side]))
    print("checks: " + "; ".join(f"{k}: {v}" for k, v in checks.items()))

    plot_path = args.plot or (None if args.no_record else PLOT)
    title = f"rlpipe vs TRL GRPOTrainer: tiny model, built-in {cfg.data.task}, CPU, equal updates"
    if plot_path is not None:
        plot(curves, plot_path, title)
        print(f"plot: {plot_path}")
    if args.no_record:
        return
    r, t = cfg.rollout, cfg.train
    per_rep = "; ".join(f"{i + 1}: rlpipe {p['wall']:.3f}s, TRL {q['wall']:.3f}s" for i, (p, q) in enumerate(pairs))
    body = (
        f"Same warm-started tiny model, task `{cfg.data.task}`, {r.prompts_per_step} prompts x n={r.n} per step, "
        f"max_new_tokens {r.max_new_tokens}, T={r.temperature}, AdamW lr {t.lr} with {t.warmup_steps} warm-up steps "
        f"(rlpipe's schedule in both), grad clip {t.grad_clip}, 1 optimizer step per RL step, no KL, GRPO advantage "
        f'with group std, token-mean loss (TRL `loss_type="{TRL_LOSS_TYPE}"`), {args.steps} updates per run, '
        f"{args.repeats} runs per side alternated (first {SKIP} steps of each run excluded from timings). "
        f"rlpipe: `rlpipe run` ({t.world_size} Ray workers x {t.threads_per_worker} threads, "
        f"{'FSDP2' if t.fsdp else 'replicated'}/gloo, packed, pack_max_length {t.pack_max_length}, shared prompts "
        f"{'on' if t.share_prompts else 'off'}). TRL {_trl_version()}: GRPOTrainer, 1 process x "
        f"{args.trl_threads} threads, per_device_train_batch_size {micro}, gradient_accumulation_steps = "
        f"steps_per_generation = {r.prompts_per_step * r.n // micro}, num_iterations 1, HF generate (no vLLM), fp32, "
        f"no gradient checkpointing. Reward: rlpipe's judge `{r.judge}` on the same decode of the same ids on both "
        "sides; TRL's prompt ids asserted equal to rlpipe's. Medians over runs; wall/step = interval between the "
        "ends of consecutive steps; step time = rollout + fit (rlpipe metrics) or on_step_begin -> on_step_end (TRL); "
        "tokens = real prompt + response tokens per step (EOS included, no padding)."
        + (f" Config overrides on both sides: `{' '.join(args.set)}`." if args.set else "")
        + "\n\n"
        + table(headers, rows)
        + f"\n\nrlpipe speedup over TRL (median of per-repeat ratios): wall per step **{speed_wall:.2f}x**, step "
        f"time {speed_step:.2f}x, tokens/s {speed_tok:.2f}x, rollout {speed_roll:.2f}x, train {speed_train:.2f}x. "
        f"Target >= {TARGET}x (wall per step): {verdict(speed_wall >= TARGET)}.\n\n"
        f"Wall per step by repeat: {per_rep}.\n\n"
        + "Checks: "
        + "; ".join(f"{k}: {v}" for k, v in checks.items())
        + ".\n\n"
        + "".join(
            f"Reward per step, {side} (median of runs): " + " ".join(f"{x:.2f}" for x in c) + "\n\n"
            for side, c in rew.items()
        )
        + f"![]({plot_path.name if plot_path and plot_path.parent == HERE else plot_path})\n\n"
        + "Differences that remain (TRL cannot be set to match):\n"
        + "".join(f"- {d}\n" for d in DIFFERENCES)
    )
    write_section("rlpipe vs TRL GRPOTrainer at equal work (CPU)", body, args.results, __file__, argv)


def equality_checks(runs: dict[str, list[dict]]) -> dict[str, bool]:
    """Settings that must agree, read back from what each side actually did."""
    trl0, rl0 = runs["TRL"][0], runs["rlpipe"][0]
    logged = trl0.get("logged_reward", [])
    own = [s["reward"] for s in trl0["steps"]]
    lr_trl = [s["lr"] for s in trl0["steps"]]
    lr_rl = [s["lr"] for s in rl0["steps"]]
    return {
        "TRL prompt ids == rlpipe prompt ids": True,  # asserted in every TRL run (it fails otherwise)
        "TRL logged reward == judge reward recorded here": len(logged) == len(own)
        and all(abs(x - y) < 1e-6 for x, y in zip(logged, own, strict=True)),
        "LR per step equal on both sides": len(lr_trl) == len(lr_rl)
        and all(abs(x - y) <= 1e-9 + 1e-6 * abs(y) for x, y in zip(lr_trl, lr_rl, strict=True)),
        "TRL activation checkpointing off": not any(r.get("activation_checkpointing", True) for r in runs["TRL"]),
    }


def _trl_version() -> str:
    try:
        from importlib.metadata import version

        return version("trl")
    except Exception:  # noqa: BLE001 - only a label
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
