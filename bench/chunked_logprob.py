"""Peak memory and time of ``chunked_logprobs`` vs ``eager_logprobs`` (full log_softmax), forward + backward.

Memory, two methods (tracemalloc does not see torch's allocations):
- torch.profiler(profile_memory=True): the ``[memory]`` alloc/free events of one pass, summed in time order; the
  maximum of that running sum is the peak of live tensor memory (exact for tensors, in-process).
- cross-check: each variant in a fresh child process (``--child VARIANT``) that allocates the inputs, reads its RSS
  (``/proc/self/statm``) as baseline, runs one pass, and reports ``VmHWM - baseline``; a fresh process keeps one
  variant's freed pages from hiding the other's peak. Children run before the parent allocates anything large.
Time: in-process passes, variants alternated per repeat; the ratio is the median of per-repeat ratios. Gradients of
both paths are compared with ``torch.testing.assert_close`` first.
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
from _common import median, table, verdict, write_section  # noqa: E402

from rlpipe.algos.logprobs import chunked_logprobs, eager_logprobs  # noqa: E402

MEM_TARGET = 0.25  # chunked peak <= 1/4 of eager
TIME_TARGET = 1.3  # chunked time <= 1.3x eager


def make_inputs(tokens: int, vocab: int, hidden: int, seed: int = 0):
    """hidden/weight with requires_grad, labels with ~25% ignored (-100, like prompt positions), upstream grad."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, hidden, generator=gen)).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[torch.rand(tokens, generator=gen) < 0.25] = -100
    g = torch.randn(tokens, generator=gen)
    return h, w, labels, g


def run_once(variant: str, chunk: int, h, w, labels, g) -> None:
    """One forward + backward of ``sum(g * logprob)``; gradients land in h.grad / w.grad."""
    h.grad = w.grad = None
    lp = eager_logprobs(h, w, labels) if variant == "eager" else chunked_logprobs(h, w, labels, chunk)
    (lp * g).sum().backward()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def profiler_peak_mb(variant: str, chunk: int, h, w, labels, g) -> float:
    """Peak of live torch CPU allocations during one pass, from torch.profiler's ``[memory]`` events (exact for
    tensors; ignores allocator caching and non-torch memory)."""
    from torch.profiler import ProfilerActivity, profile

    h.grad = w.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_once(variant, chunk, h, w, labels, g)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def _hwm_bytes() -> int:
    """VmHWM: this address space's own RSS high-water mark. Not ``ru_maxrss``, which after fork+exec starts at the
    parent's RSS at fork time (Linux keeps the pre-exec mm's peak in the signal struct) and so hides the pass."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(args) -> None:
    """RSS cross-check: one pass of one variant in this (fresh) process; prints one JSON line."""
    torch.set_num_threads(args.threads)
    h, w, labels, g = make_inputs(args.tokens, args.vocab, args.hidden)
    base = _rss_bytes()
    peak_before = _hwm_bytes()
    run_once(args.child, args.chunk, h, w, labels, g)
    peak = _hwm_bytes()
    # reliable: the pass itself set the process peak (not e.g. the torch import)
    print(json.dumps({"rss_mb": (peak - base) / 2**20, "reliable": peak > peak_before}))


def rss_peak_mb(variant: str, chunk: int, args) -> float | None:
    """Extra peak RSS of one pass in a fresh child process; None when the import, not the pass, set the peak."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--chunk", str(chunk),
           "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--threads", str(args.threads)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return out["rss_mb"] if out["reliable"] else None


def check_gradients(args) -> float:
    """Both paths on the same inputs: values and both gradients must agree; returns the max |grad_W| difference."""
    torch.set_num_threads(args.threads)
    h, w, labels, g = make_inputs(args.tokens, args.vocab, args.hidden)
    run_once("eager", args.chunk, h, w, labels, g)
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    run_once("chunked", args.chunk, h, w, labels, g)
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(chunked_logprobs(h, w, labels, args.chunk), eager_logprobs(h, w, labels))
    return float((w.grad - ref_w).abs().max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternated timed passes per variant (median reported)")
    ap.add_argument("--quick", action="store_true", help="small shapes, 1 repeat, no RSS children (smoke test)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=1024, help="chunk size judged against the targets")
    ap.add_argument("--extra-chunks", default="256", help="comma list of further chunk sizes to report ('' = none)")
    ap.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS cross-check")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default bench/RESULTS.md)")
    ap.add_argument("--child", choices=["eager", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.tokens, args.vocab, args.hidden, args.chunk, args.repeats = 1024, 8192, 128, 256, 1
        args.extra_chunks, args.no_rss = "", True
    torch.set_num_threads(args.threads)
    variants = [("eager", args.chunk), ("chunked", args.chunk)]
    variants += [("chunked", int(c)) for c in args.extra_chunks.split(",") if c.strip()]
    rss = {v: None if args.no_rss else rss_peak_mb(v[0], v[1], args) for v in variants}  # before the parent grows
    grad_diff = check_gradients(args)  # also the warm-up of the default-chunk paths
    h, w, labels, g = make_inputs(args.tokens, args.vocab, args.hidden)
    peaks = {v: profiler_peak_mb(v[0], v[1], h, w, labels, g) for v in variants}
    times: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants if r % 2 == 0 else variants[::-1]:
            t0 = time.perf_counter()
            run_once(v[0], v[1], h, w, labels, g)
            times[v].append(time.perf_counter() - t0)
    eager = ("eager", args.chunk)
    rows, verdicts = [], {}
    for v in variants:
        mem_ratio = peaks[v] / peaks[eager]
        time_ratio = median([t / e for t, e in zip(times[v], times[eager], strict=True)])
        rss_cell = "n/a" if rss[v] is None else rss[v]
        rss_ratio = "n/a" if rss[v] is None or rss[eager] is None else rss[v] / rss[eager]
        name = "eager (full log_softmax)" if v == eager else f"chunked, chunk={v[1]}"
        rows.append([name, peaks[v], rss_cell, median(times[v]), mem_ratio, rss_ratio, time_ratio])
        if v == ("chunked", args.chunk):
            verdicts = {"mem": mem_ratio, "time": time_ratio}
    mem_ok, time_ok = verdicts["mem"] <= MEM_TARGET, verdicts["time"] <= TIME_TARGET
    print(f"chunked_logprob ratio: peak memory = {verdicts['mem']:.3f}x eager (target <= {MEM_TARGET}), "
          f"time = {verdicts['time']:.2f}x eager (target <= {TIME_TARGET})")  # fmt: skip
    body = (
        f"{args.tokens} tokens, vocab {args.vocab}, hidden {args.hidden}, fp32, forward + backward of "
        f"sum(g * logprob) w.r.t. hidden and LM head; ~25% labels -100. Peak = torch.profiler live-allocation "
        f"peak of one pass; RSS = VmHWM minus RSS after allocating inputs, one pass in a fresh child process "
        f"(n/a: skipped or the import set the peak). Time = median of {args.repeats} alternated passes. "
        f"Gradients checked equal (assert_close; max |dW| diff {grad_diff:.2e}).\n\n"
        + table(
            [
                "variant",
                "peak torch alloc (MB)",
                "peak extra RSS (MB)",
                "time (s)",
                "peak / eager",
                "RSS / eager",
                "time / eager",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nTargets (chunk={args.chunk}): peak <= {MEM_TARGET} x eager: {verdict(mem_ok)} "
        f"({verdicts['mem']:.3f}); time <= {TIME_TARGET} x eager: {verdict(time_ok)} ({verdicts['time']:.2f}).\n"
    )
    write_section("Chunked vs eager logprobs: peak memory and time", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
