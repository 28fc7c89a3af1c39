"""Peak memory and step time of one policy training step on SmolLM2-135M with the memory/throughput switches:
fp32 baseline, activation checkpointing (`train.activation_checkpointing`), bf16 mixed precision
(`train.mixed_precision=bf16`, the replicated policy's autocast path), both; and the AdamW kernels
(`train.optimizer_impl`); with ``--compile``, the step time of `train.compile` (torch.compile of each decoder
layer, inductor) against eager, and how long its first step (the compilation) takes.

One step = forward + backward of a token-weighted logprob loss over one pack (rlpipe's PolicyModel, chunked
logprobs, packed sdpa) + AdamW. Memory, per variant in a fresh child process (``--child VARIANT``): the model is
loaded, one warm-up step allocates the AdamW state, then the measured (steady-state) step:
- peak torch alloc: torch.profiler(profile_memory=True) live-allocation peak of that step above what was live
  before it (activations, gradients, temporaries; weights and AdamW state excluded);
- peak RSS: the child's VmHWM minus its RSS after loading the model (so it includes the AdamW state and the
  warm-up step), a cross-check that sees the allocator too.
Time: one child holds a plain and a checkpointed copy of the model and alternates the four variants per repeat
(rotating order); ratios are medians of per-repeat ratios. AdamW kernels: `optimizer.step()` of the same
optimizer and state with its kernel switched (`set_optimizer_impl`) in alternation. Gradients/loss of the variants
are compared with the baseline first (checkpointing: equal; bf16: close).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table, write_section  # noqa: E402

DEFAULT_MODEL = "runs/bench/smollm2-135m-instruct-float32"
VARIANTS = {  # name -> (activation_checkpointing, mixed_precision)
    "fp32": (False, "off"),
    "checkpointing": (True, "off"),
    "bf16": (False, "bf16"),
    "checkpointing+bf16": (True, "bf16"),
}
IMPLS = ("for_loop", "foreach", "fused")


def make_pack(tokens: int, seq_len: int, vocab: int, seed: int = 0):
    """`tokens // seq_len` random sequences of `seq_len` tokens in one pack; the last quarter of each is labelled
    (a response), the rest is prompt."""
    from rlpipe.data.packing import SequenceItem, pack_sequences

    g = torch.Generator().manual_seed(seed)
    response = seq_len // 4
    items = [
        SequenceItem(
            prompt_ids=torch.randint(3, vocab, (seq_len - response,), generator=g).tolist(),
            response_ids=torch.randint(3, vocab, (response,), generator=g).tolist(),
            advantage=1.0,
            rollout_logprobs=[0.0] * response,
            row=i,
        )
        for i in range(tokens // seq_len)
    ]
    (pack,) = pack_sequences(items, tokens, pad_token_id=0, pad_to_max_length=False)
    return pack


def build(model_dir: str, checkpointing: bool, impl: str = "foreach", compile_layers: bool = False):
    """PolicyModel + AdamW as the worker builds a replicated policy (`_build_policy`), fp32 master weights."""
    from rlpipe.config import TrainConfig
    from rlpipe.models.loading import load_model
    from rlpipe.models.packed_attention import scoring_attention
    from rlpipe.train.optim import build_optimizer
    from rlpipe.train.policy import PolicyModel, apply_layer_options

    hf = load_model(model_dir, "float32", "cpu", attn_implementation=scoring_attention("sdpa", True))
    hf.config.use_cache = False
    hf.train()
    apply_layer_options(hf, checkpointing, compile_layers=compile_layers)
    policy = PolicyModel(hf, chunk_size=1024)
    return policy, build_optimizer(policy.parameters(), TrainConfig(lr=1e-5, optimizer_impl=impl), "cpu")


def step(policy, optimizer, pack, mixed_precision: str) -> float:
    """One training step; returns the loss."""
    from rlpipe.train.policy import autocast_dtype

    policy.autocast_dtype = autocast_dtype(mixed_precision)
    logprobs = policy.logprobs(pack)
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.numel())).sum() / max(1, pack.num_label_tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    """VmHWM of this address space (not ru_maxrss, which inherits the parent's peak across fork+exec)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def profiled_step_peak_mb(policy, optimizer, pack, mixed_precision: str) -> float:
    """Peak of live torch allocations during forward + backward of one step, above what was live before it (profiler [memory] events)."""
    from torch.profiler import ProfilerActivity, profile

    from rlpipe.train.policy import autocast_dtype

    policy.autocast_dtype = autocast_dtype(mixed_precision)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # forward + backward only: the
        logprobs = policy.logprobs(pack)  # optimizer's temporaries (~2x the weights for foreach) would set the peak
        (-logprobs.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def child_memory(args) -> None:
    """Memory of one variant in this fresh process; prints one JSON line."""
    checkpointing, mixed_precision = VARIANTS[args.child]
    policy, optimizer = build(args.model, checkpointing)
    pack = make_pack(args.tokens, args.seq_len, policy.hf.config.vocab_size)
    base = _rss_bytes()
    step(policy, optimizer, pack, mixed_precision)  # allocates the AdamW state
    torch_peak = profiled_step_peak_mb(policy, optimizer, pack, mixed_precision)
    print(json.dumps({"torch_peak_mb": torch_peak, "rss_extra_mb": (_hwm_bytes() - base) / 2**20,
                      "hwm_mb": _hwm_bytes() / 2**20}))  # fmt: skip


def child_timing(args) -> None:
    """Step times of every variant and AdamW kernel, alternated, in this one process; prints one JSON line."""
    from rlpipe.train.optim import set_optimizer_impl

    models = {False: build(args.model, False), True: build(args.model, True)}
    pack = make_pack(args.tokens, args.seq_len, models[False][0].hf.config.vocab_size)
    checks = _check_gradients(models, pack)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up (AdamW state, allocator)
        step(*models[VARIANTS[name][0]], pack, VARIANTS[name][1])
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            checkpointing, mixed_precision = VARIANTS[name]
            t0 = time.perf_counter()
            step(*models[checkpointing], pack, mixed_precision)
            times[name].append(time.perf_counter() - t0)
    compiled = _compile_timing(args, models[False], pack) if args.compile else None
    policy, optimizer = models[False]
    opt_times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(args.opt_repeats + 1):
        for impl in IMPLS[r % 3 :] + IMPLS[: r % 3]:
            set_optimizer_impl(optimizer, impl)
            for p in policy.parameters():
                p.grad = torch.full_like(p, 1e-3)
            t0 = time.perf_counter()
            optimizer.step()
            if r > 0:  # the first round is the warm-up of each kernel
                opt_times[impl].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in policy.parameters())
    print(json.dumps({"times": times, "opt_times": opt_times, "checks": checks, "params": params,
                      "compiled": compiled}))  # fmt: skip


def _compile_timing(args, eager, pack) -> dict:
    """`train.compile` vs eager (fp32, no checkpointing): first compiled step (the compilation), then alternated
    steady-state steps; the compiled logprobs are checked against eager on the same weights first."""
    compiled = build(args.model, False, compile_layers=True)
    compiled[0].load_state_dict(eager[0].state_dict())
    with torch.no_grad():
        t0 = time.perf_counter()
        diff = float((compiled[0].logprobs(pack) - eager[0].logprobs(pack)).abs().max())
        first_s = time.perf_counter() - t0
    if diff > 1e-4:
        raise AssertionError(f"compiled decoder layers changed the logprobs by {diff}")
    step(*compiled, pack, "off")  # compiles the backward
    pairs: list[tuple[float, float]] = []
    for r in range(args.repeats):
        timed = {}
        for name, (policy, optimizer) in (("eager", eager), ("compiled", compiled))[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            step(policy, optimizer, pack, "off")
            timed[name] = time.perf_counter() - t0
        pairs.append((timed["eager"], timed["compiled"]))
    return {"first_forward_s": first_s, "max_logprob_diff": diff, "eager": [e for e, _ in pairs],
            "compiled": [c for _, c in pairs]}  # fmt: skip


def _check_gradients(models, pack) -> dict[str, float]:
    """Checkpointing must not change the gradients; bf16 must stay close. Relative L2 errors vs fp32."""

    def grads(checkpointing: bool, mixed_precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        from rlpipe.train.policy import autocast_dtype

        policy = models[checkpointing][0]
        policy.autocast_dtype = autocast_dtype(mixed_precision)
        policy.zero_grad(set_to_none=True)
        logprobs = policy.logprobs(pack)
        logprobs.sum().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in policy.parameters()])
        policy.zero_grad(set_to_none=True)
        assert logprobs.dtype == torch.float32
        return flat, logprobs.detach()

    ref, ref_lp = grads(False, "off")
    out = {}
    for name, (checkpointing, mixed_precision) in VARIANTS.items():
        if name == "fp32":
            continue
        g, lp = grads(checkpointing, mixed_precision)
        out[f"{name} grad rel. error"] = float((g - ref).norm() / ref.norm())
        out[f"{name} max |logprob diff|"] = float((lp - ref_lp).abs().max())
    if out["checkpointing grad rel. error"] > 1e-5:
        raise AssertionError(f"activation checkpointing changed the gradients: {out}")
    return out


def run_child(kind: str, variant: str | None, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--tokens", str(args.tokens),
           "--seq-len", str(args.seq_len), "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--opt-repeats", str(args.opt_repeats)] + (["--compile"] if args.compile else [])  # fmt: skip
    cmd += ["--child", variant] if kind == "memory" else ["--timing-child"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{kind} child {variant} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def report(args, memory: dict[str, dict], timing: dict, load: str) -> str:
    times, base = timing["times"], "fp32"
    rows = []
    for name in VARIANTS:
        mem, ref = memory[name], memory[base]
        ratio = median([t / b for t, b in zip(times[name], times[base], strict=True)])
        rows.append([name, mem["torch_peak_mb"], mem["torch_peak_mb"] / ref["torch_peak_mb"], mem["rss_extra_mb"],
                     mem["rss_extra_mb"] / ref["rss_extra_mb"], median(times[name]), ratio])  # fmt: skip
    opt = timing["opt_times"]
    opt_rows = [[impl, median(opt[impl]) * 1e3,
                 median([t / b for t, b in zip(opt[impl], opt["for_loop"], strict=True)])] for impl in IMPLS]  # fmt: skip
    checks = "; ".join(f"{k} {v:.2e}" for k, v in timing["checks"].items())
    return (
        f"SmolLM2-135M-Instruct (`{args.model}`, fp32 master weights), one pack of {args.tokens} tokens "
        f"({args.tokens // args.seq_len} sequences of {args.seq_len}, last quarter labelled), CPU, "
        f"{args.threads} torch thread(s); load average before/after: {load}. Peak torch alloc = profiler live-"
        f"allocation peak of a steady-state step above the weights and AdamW state; peak RSS = child VmHWM minus "
        f"its RSS after loading (includes AdamW state). Step time = median of {args.repeats} alternated steps, "
        f"ratio = median of per-repeat ratios to fp32. Checks vs fp32: {checks}.\n\n"
        + table(
            [
                "variant",
                "peak torch alloc (MB)",
                "alloc / fp32",
                "peak RSS extra (MB)",
                "RSS / fp32",
                "step time (s)",
                "time / fp32",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nAdamW `optimizer.step()` over all {timing['params'] / 1e6:.0f}M parameters, same state, kernel "
        f"switched per step (median of {args.opt_repeats}):\n\n"
        + table(["train.optimizer_impl", "step (ms)", "time / for_loop"], opt_rows)
        + "\n"
        + _compile_report(timing.get("compiled"))
    )


def _compile_report(compiled: dict | None) -> str:
    if not compiled:
        return ""
    eager, comp = compiled["eager"], compiled["compiled"]
    ratio = median([c / e for c, e in zip(comp, eager, strict=True)])
    return (
        f"\n`train.compile` (inductor, each decoder layer), fp32, alternated with eager ({len(comp)} pairs): step "
        f"{median(comp):.3f} s vs eager {median(eager):.3f} s, **{ratio:.2f}x** eager's time; first forward (compiles "
        f"the layers) {compiled['first_forward_s']:.1f} s; max |logprob diff| vs eager "
        f"{compiled['max_logprob_diff']:.1e}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="converted HF dir of SmolLM2-135M (bench/smollm2.py)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens in the pack")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=3, help="alternated timed steps per variant")
    ap.add_argument("--opt-repeats", type=int, default=5, help="timed optimizer steps per AdamW kernel")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default bench/RESULTS.md)")
    ap.add_argument("--no-record", action="store_true", help="print, do not append to RESULTS.md")
    ap.add_argument("--compile", action="store_true", help="also time train.compile against eager (slow start)")
    ap.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--timing-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        child_memory(args)
        return 0
    if args.timing_child:
        child_timing(args)
        return 0
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"no converted model at {args.model}: run bench/smollm2.py first (or pass --model)")
    load_before = os.getloadavg()[0]
    memory = {name: run_child("memory", name, args) for name in VARIANTS}
    timing = run_child("timing", None, args)
    load = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"
    body = report(args, memory, timing, load)
    print(body)
    if not args.no_record:
        write_section("Activation checkpointing, bf16 mixed precision, AdamW kernels (SmolLM2-135M)", body,
                      args.results, __file__, argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
