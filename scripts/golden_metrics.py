"""Golden metrics: prove that a refactor changed no numbers.

`record` runs `rlpipe run` twice on the same config, keeps the columns on which the two runs agree to the last bit
(timings, memory and anything else this machine does not reproduce fall out by themselves), and writes them as JSON.
`compare` runs once more and reports every cell that differs from the recorded file.

    .venv/bin/python scripts/golden_metrics.py record tests/golden/hf-20.json --set iterations=20
    .venv/bin/python scripts/golden_metrics.py record /tmp/vllm-6.json --set iterations=6 --set rollout.engine=vllm
    .venv/bin/python scripts/golden_metrics.py compare tests/golden/hf-20.json
    .venv/bin/python scripts/golden_metrics.py record-format1 tests/golden/AuthenticAMD-AVX2/format1-resume.json

`tests/integration/test_golden_metrics.py` runs `compare` for the HF file in the suite.

The bits depend on the CPU as well as the code: MKL and ATen pick their kernels by vendor and SIMD level, so a run
on another kind of CPU samples other tokens from the first iteration on. `tests/golden/hf-20.json` and the
format-1 fixture's metrics were recorded on the CI machines of 2026-12 up to stop 38; a platform with its own
recording (`numerics_platform()`, e.g. `tests/golden/AuthenticAMD-AVX2/`) is compared against that instead
(`golden_file`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


EXPERIMENT = "golden"
GOLDEN_DIR = REPO / "tests" / "golden"
FORMAT1 = REPO / "tests" / "fixtures" / "checkpoint-format1"


def numerics_platform() -> str:
    """What fixes the bits of a CPU run besides the code: the CPU vendor and the SIMD level of torch's kernels."""
    import torch

    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{vendor}-{torch.backends.cpu.get_cpu_capability()}"


def golden_file(name: str) -> Path | None:
    """This platform's own recording of `name` if it has one, else None (use the original recording)."""
    path = GOLDEN_DIR / numerics_platform() / name
    return path if path.is_file() else None


def run_once(overrides: list[str], workdir: Path, resume: bool = False) -> list[dict[str, float]]:
    """Metrics rows of one `rlpipe run` in a fresh output and checkpoint root (the base model is built there too);
    `resume` continues a checkpoint placed under `workdir/ckpt/golden/` beforehand."""
    sets = [
        *overrides,
        f"output_dir={workdir / 'out'}",
        f"checkpoint.root={workdir / 'ckpt'}",
        f"experiment={EXPERIMENT}",
    ]
    cmd = [sys.executable, "-m", "rlpipe.cli", "run", *[a for s in sets for a in ("--set", s)]]
    cmd += ["--resume"] if resume else []
    # this checkout's code, in the driver and in the Ray workers it starts (they inherit the environment)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    lines = (workdir / "out" / EXPERIMENT / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def agreeing_columns(a: list[dict[str, float]], b: list[dict[str, float]]) -> list[str]:
    """Keys present in every row of both runs with bit-equal values in every row."""
    if len(a) != len(b):
        raise SystemExit(f"the two runs have {len(a)} and {len(b)} rows")
    keys = set.intersection(*(set(r) for r in a + b))
    return sorted(k for k in keys if all(_same(x[k], y[k]) for x, y in zip(a, b, strict=True)))


def _same(x: float, y: float) -> bool:
    return json.dumps(x) == json.dumps(y)  # NaN == NaN, 0.0 != -0.0: the last bit, as JSON writes it


def differences(golden: dict, rows: list[dict[str, float]]) -> list[str]:
    """Every recorded cell the new rows do not reproduce, as readable lines."""
    want = golden["rows"]
    if len(want) != len(rows):
        return [f"{len(rows)} rows, the golden file has {len(want)}"]
    out = []
    for i, (w, r) in enumerate(zip(want, rows, strict=True)):
        for key, value in w.items():
            if key not in r:
                out.append(f"row {i}: {key} missing")
            elif not _same(value, r[key]):
                out.append(f"row {i}: {key} = {r[key]!r}, golden {value!r}")
    return out


def record(path: Path, overrides: list[str]) -> None:
    _record_twice(path, lambda workdir: run_once(overrides, workdir), {"overrides": overrides})


def _record_twice(path: Path, run: Callable[[Path], list[dict[str, float]]], header: dict) -> None:
    """`run` twice in fresh directories; write `header` and the columns on which both runs agree to the last bit."""
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        a, b = run(Path(d1)), run(Path(d2))
    cols = agreeing_columns(a, b)
    dropped = sorted(set().union(*(set(r) for r in a)) - set(cols))
    golden = {**header, "columns": cols, "dropped": dropped, "rows": [{k: r[k] for k in cols} for r in a]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"{path}: {len(a)} rows, {len(cols)} reproducible columns on {numerics_platform()}; not reproducible "
          f"here: {', '.join(dropped)}")  # fmt: skip


def resume_format1(workdir: Path) -> list[dict[str, float]]:
    """Rows 3-4 of a 4-iteration run resumed from the format-1 fixture's iteration-2 checkpoint."""
    import shutil

    shutil.copytree(FORMAT1 / "step-000002", workdir / "ckpt" / EXPERIMENT / "step-000002")
    return run_once(["iterations=4"], workdir, resume=True)


def record_format1(path: Path) -> None:
    """This platform's rows of the format-1 resume."""
    _record_twice(path, resume_format1, {})


def compare(path: Path) -> int:
    golden = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as d:
        rows = run_once(golden["overrides"], Path(d))
    diff = differences(golden, rows)
    print("\n".join(diff) if diff else f"{path}: all {len(golden['columns'])} columns of {len(rows)} rows equal")
    return 1 if diff else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["record", "compare", "record-format1"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (record)")
    args = parser.parse_args()
    if args.action == "record":
        record(args.path, args.set)
        return 0
    if args.action == "record-format1":
        record_format1(args.path)
        return 0
    return compare(args.path)


if __name__ == "__main__":
    sys.exit(main())
