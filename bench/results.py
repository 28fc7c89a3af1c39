"""Append a measured section to bench/RESULTS.md with the command, machine and date (shared by all benchmarks)."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    import torch

    return f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}, torch {torch.__version__}"


def append_section(title: str, command: str, rows: list[tuple[str, str]], extra: str = "") -> None:
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Benchmark results\n\nEvery section is appended by the script named in it; rerun to check.\n"
        )
    lines = [
        f"\n## {title}\n",
        f"- command: `{command}`",
        f"- machine: {machine()}",
        f"- date: {_dt.datetime.now(_dt.UTC).isoformat(timespec='seconds')}\n",
        "| measure | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        extra,
    ]
    with RESULTS.open("a") as fh:
        fh.write("\n".join(lines))
