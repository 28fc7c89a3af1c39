"""Peak memory per training rank with the policy FSDP2-sharded (issue 18.4): old vs new setup, 2 gloo ranks.

Command (from the repo root; ~2 min on 2 otherwise idle cores):

    .venv/bin/python bench/memory_per_rank.py

(``--model-dir DIR`` for another HF model dir, default the converted SmolLM2-135M-Instruct that ``bench/smollm2.py``
writes to ``runs/bench/smollm2-135m-instruct-float32``; ``--quick`` runs the tiny default model in seconds;
``--no-record`` prints only.)

Two setups of ``TrainingWorker`` with ``train.fsdp=true`` and ``algo.use_kl_loss=true`` (policy + AdamW + KL
reference), each in its own 2-process spawn so one's peak cannot leak into the other's:

- old: the worker's setup before issue 18.4 (reproduced below from commit bde7a41): every rank loads the full
  model, then shards it; every rank loads a full reference copy (parked on CPU).
- new: ``TrainingWorker.setup``: meta-device init, FSDP2 sharding, then each rank reads only its own slices of the
  safetensors; the reference is sharded the same way.

Per rank it records: peak RSS (``ru_maxrss``) after imports (the baseline), after setup and after one RL step
(a short pack; reference forward, forward/backward, AdamW step), and the bytes of the tensors the rank holds
(its policy parameters, AdamW states after the step, reference parameters: local shards of DTensors). The HF
rollout copy (a full replica per rank, built on the first colocated ``generate``) is not part of either setup;
see docs/ARCHITECTURE.md for why it stays.

The ranks run with glibc's ``MALLOC_MMAP_THRESHOLD_=131072`` and ``MALLOC_TRIM_THRESHOLD_=0`` so that freed tensor
memory goes back to the OS at once and peak RSS tracks the tensors alive at the peak. Without it, freed blocks stay
in glibc's free lists, RSS keeps them, and the peaks drift by hundreds of MiB between ranks and runs (measured:
the same rank's step peak varied from 2.5 to 3.7 GiB between two runs of identical code).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "runs/bench/smollm2-135m-instruct-float32"
MIB = 2**20
# glibc reads these at process start; the spawned ranks inherit them (see the module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"}


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _old_setup(worker, master_addr: str, master_port: int) -> None:
    """`TrainingWorker.setup` as of bde7a41 with `train.fsdp=true`: full load on every rank, then shard; a full
    reference per rank (on CPU)."""
    from rlpipe.train import worker as worker_module
    from rlpipe.train.distributed import backend_for, init_process_group
    from rlpipe.train.optim import build_optimizer
    from rlpipe.train.policy import shard_policy

    worker_module._seed_everything(worker.cfg.train.seed + worker.rank, worker.cfg.train.deterministic)
    init_process_group(worker.rank, worker.world_size, master_addr, master_port, backend_for(worker.device))
    worker.mesh = worker_module._data_mesh(worker.device, worker.world_size)
    policy = worker._loaded_policy(worker.model_dir, str(worker.device))
    policy.hf.config.use_cache = False
    policy.train()
    worker._sharded = True
    worker.policy = shard_policy(policy, worker.mesh["dp"], worker.cfg.train.fsdp_reshard_after_forward)
    worker.optimizer = build_optimizer(worker.policy.parameters(), worker.cfg.train)
    worker.ref = worker._loaded_policy(worker.model_dir, "cpu")
    worker.ref.eval().requires_grad_(False)
    worker.rollout_model, worker._rollout_stale = None, True
    worker.optimizer_step, worker.skipped_steps = 0, 0


def _one_pack(vocab: int):
    import torch

    from rlpipe.data.packing import SequenceItem, pack_sequences

    g = torch.Generator().manual_seed(0)
    items = [
        SequenceItem(prompt_ids=torch.randint(3, vocab, (24,), generator=g).tolist(),
                     response_ids=torch.randint(3, vocab, (8,), generator=g).tolist(), advantage=(-1.0) ** i, row=i)
        for i in range(4)
    ]  # fmt: skip
    return pack_sequences(items, 128, pad_token_id=0, dp_size=2, pad_to_max_length=False)


def _rank_main(rank: int, variant: str, port: int, cfg_json: str, model_dir: str, out: str) -> None:
    import json

    import torch

    from rlpipe.train.worker import TrainingWorker

    worker = TrainingWorker(cfg_json, model_dir, rank, 2)
    baseline = _peak_rss()
    if variant == "old":
        _old_setup(worker, "127.0.0.1", port)
    else:
        worker.setup("127.0.0.1", port)
    setup_peak = _peak_rss()
    packs = _one_pack(worker.policy.hf.config.vocab_size)[rank::2]
    worker.fit(packs, [len(packs)], 0, 1)
    opt_states = [t for state in worker.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    row = {
        "baseline": baseline,
        "setup_peak": setup_peak,
        "step_peak": _peak_rss(),
        "policy_bytes": _local_bytes(worker.policy.parameters()),
        "optimizer_bytes": _local_bytes(t for t in opt_states if t.dim() > 0),
        "ref_bytes": _local_bytes(worker.ref.parameters()),
    }
    Path(out.format(rank=rank)).write_text(json.dumps(row))
    worker.shutdown()


def measure(variant: str, model_dir: str, work: Path) -> list[dict]:
    """One 2-rank spawn of `variant`; per-rank rows."""
    import json

    import torch.multiprocessing as mp

    from rlpipe.config import load_config
    from rlpipe.train.distributed import free_port

    overrides = {"train.world_size": 2, "train.fsdp": True, "algo.use_kl_loss": True, "model.path": model_dir,
                 "output_dir": str(work / "out"), "train.pack_max_length": 128, "data.max_prompt_length": 64,
                 "rollout.max_new_tokens": 16}  # fmt: skip
    cfg = load_config(overrides=overrides)
    out = str(work / f"{variant}-rank{{rank}}.json")
    mp.spawn(_rank_main, args=(variant, free_port(), cfg.model_dump_json(), model_dir, out), nprocs=2, join=True)
    return [json.loads(Path(out.format(rank=r)).read_text()) for r in range(2)]


def _model_bytes(model_dir: str) -> int:
    from rlpipe.models.loading import empty_model

    return sum(p.numel() * p.element_size() for p in empty_model(model_dir).parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL), help="HF model dir (safetensors).")
    parser.add_argument("--quick", action="store_true", help="The tiny default model (a seconds-long smoke run).")
    parser.add_argument("--no-record", action="store_true", help="Print only; do not append to RESULTS.md.")
    parser.add_argument("--results", type=Path, default=None, help="RESULTS.md to append to.")
    args = parser.parse_args(argv)

    os.environ.update(MALLOC_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = args.model_dir
        if args.quick:
            from rlpipe.models.tiny import create_tiny_model_dir

            model_dir = create_tiny_model_dir(work / "tiny")
        elif not Path(model_dir).is_dir():
            sys.exit(
                f"{model_dir} does not exist: run bench/smollm2.py once (it converts the GGUF) or pass --model-dir"
            )
        full = _model_bytes(model_dir)
        rows = {variant: measure(variant, model_dir, work) for variant in ("old", "new")}
    load = os.getloadavg()
    report = _report(rows, full, model_dir, load)
    print(report)
    if not args.no_record:
        write_section("Peak memory per rank: sharded reference and meta-init sharded load (memory_per_rank.py)",
                      report, args.results, __file__, argv)  # fmt: skip


def _report(rows: dict[str, list[dict]], full: int, model_dir: str, load: tuple[float, float, float]) -> str:
    headers = ["setup", "rank", "baseline RSS MiB", "setup peak RSS MiB", "setup peak - baseline MiB",
               "peak after 1 step MiB", "policy params MiB", "AdamW states MiB", "reference params MiB"]  # fmt: skip
    body = []
    for variant, ranks in rows.items():
        for rank, r in enumerate(ranks):
            body.append([variant, rank, r["baseline"] / MIB, r["setup_peak"] / MIB,
                         (r["setup_peak"] - r["baseline"]) / MIB, r["step_peak"] / MIB, r["policy_bytes"] / MIB,
                         r["optimizer_bytes"] / MIB, r["ref_bytes"] / MIB])  # fmt: skip

    def worst(variant: str, key: str, minus_baseline: bool = False) -> float:
        return max(r[key] - (r["baseline"] if minus_baseline else 0) for r in rows[variant])

    setup_ratio = worst("new", "setup_peak", True) / worst("old", "setup_peak", True)
    step_ratio = worst("new", "step_peak", True) / worst("old", "step_peak", True)
    ref_ratio = worst("new", "ref_bytes") / worst("old", "ref_bytes")
    return (
        f"Model: `{Path(model_dir).name}` ({full / MIB:.0f} MiB of fp32 parameters), 2 ranks (gloo, CPU), "
        f"`train.fsdp=true`, KL on, glibc returning freed memory at once (`MALLOC_MMAP_THRESHOLD_=131072`); load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.\n\n"
        + table(headers, body)
        + "\n\nRatios new/old (worst rank): setup peak RSS above the baseline "
        f"{setup_ratio:.2f}x, peak RSS above the baseline after one RL step {step_ratio:.2f}x, reference bytes "
        f"per rank {ref_ratio:.2f}x (1/world_size = 0.5 is the target).\n"
    )


if __name__ == "__main__":
    main()
