"""Smoke test of the benchmark scripts: each runs with ``--quick`` and prints its ratio line.

Each script's ``main(argv)`` is called in-process (one torch import for all, to stay within the smoke budget) with a
temporary results file, never bench/RESULTS.md. The Ray scaling script needs a Ray start plus three worker
processes, which alone takes well over the smoke budget on a shared 2-core machine, so it runs as a subprocess and
is marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, results: Path, timeout: float) -> str:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _check_section(results: Path, title: str) -> None:
    text = results.read_text()
    assert text.startswith("# rlpipe benchmark results")
    assert f"## {title}" in text
    assert "- command: `python " in text  # the exact command is recorded
    assert re.search(r"nproc=\d+, torch.get_num_threads\(\)=\d+", text)
    assert re.search(r"\*\*(met|missed)\*\*", text)


def _main(script: str, results: Path, capsys) -> str:
    """Import bench/<script> by path and run ``main(["--quick", "--results", results])``; return its stdout."""
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    assert module.main(["--quick", "--results", str(results)]) == 0
    return capsys.readouterr().out


def test_packing_quick(tmp_path, capsys):
    out = _main("packing.py", tmp_path / "r.md", capsys)
    assert re.search(r"packing ratio \[tiny, budget \d+\]: packed/padded tokens/s = \d+\.\d+x", out)
    _check_section(tmp_path / "r.md", "Packing: packed vs padded training throughput")


def test_chunked_logprob_quick(tmp_path, capsys):
    out = _main("chunked_logprob.py", tmp_path / "r.md", capsys)
    m = re.search(r"chunked_logprob ratio: peak memory = (\d+\.\d+)x eager .* time = (\d+\.\d+)x eager", out)
    assert m, out
    assert float(m.group(1)) < 1.0  # chunking must reduce the peak even at smoke-test shapes
    _check_section(tmp_path / "r.md", "Chunked vs eager logprobs: peak memory and time")


def test_results_file_is_appended_not_overwritten(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from _common import write_section
    finally:
        sys.path.remove(str(BENCH))
    results = tmp_path / "r.md"
    write_section("first", "| a |\n|---|\n| 1 |", results, str(BENCH / "x.py"), ["--quick"])
    write_section("second", "body two", results, str(BENCH / "x.py"), [])
    text = results.read_text()
    assert text.count("# rlpipe benchmark results") == 1
    assert text.index("## first") < text.index("## second")
    assert "| 1 |" in text and "body two" in text
    assert "- command: `python bench/x.py --quick`" in text


def test_warmup_probe_quick(tmp_path, capsys):
    out = _main("warmup_probe.py", tmp_path / "r.md", capsys)
    m = re.search(r"warm-up 5 steps: sampled (\d\.\d+), greedy (\d\.\d+)", out)
    assert m, out
    assert 0.0 <= float(m.group(1)) <= 1.0 and 0.0 <= float(m.group(2)) <= 1.0
    text = (tmp_path / "r.md").read_text()
    assert "## Warm-up probe: where RL starts" in text and "| 5 |" in text


@pytest.mark.slow
def test_orchestration_quick(tmp_path):
    out = _run("orchestration.py", tmp_path / "r.md", 900)
    assert re.search(r"grpo workflow overhead vs rlpipe run: [+-]\d+\.\d%", out)
    _check_section(tmp_path / "r.md", "Orchestration overhead: Flyte workflows vs rlpipe run")


@pytest.mark.slow
def test_scaling_quick(tmp_path):
    out = _run("scaling.py", tmp_path / "r.md", 600)
    assert re.search(r"scaling ratio: fit time ws=1 / ws=2 = \d+\.\d+x", out)
    _check_section(tmp_path / "r.md", "Scaling: 1 vs 2 Ray training workers")


@pytest.mark.slow
def test_layouts_quick(tmp_path):
    out = _run("layouts.py", tmp_path / "r.md", 600)
    for name in ("replicated", "fsdp2", "fsdp2-reshard"):
        assert re.search(rf"{name}: wall/step \d+\.\d+ s; replicated is \d+\.\d+x as fast", out), out
    assert "## Training layouts: replicated vs FSDP2" in (tmp_path / "r.md").read_text()


def _load(script: str):
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_async_rollout_compares_rewards_at_equal_weight_versions():
    """k=1 trains iteration t on a batch from the weights after t-2: per iteration it lags one update. The bench
    compares rewards per weight version, so two runs that learn identically per update compare as equal."""
    bench = _load("async_rollout.py")
    learn = [0.1 * v for v in range(12)]  # reward of the weights after v updates, the same for both runs
    k0 = [{"iteration": t, "reward_mean": learn[t - 1]} for t in range(1, 13)]  # sampled from the weights after t-1
    k1 = [{"iteration": t, "reward_mean": learn[max(0, t - 2)], "pipeline/weights_iteration": max(0, t - 2)}
          for t in range(1, 13)]  # fmt: skip
    assert bench.by_version(k1) == {v: learn[v] for v in range(11)}
    diff, two_se, basis = bench.reward_verdict([k0], [k1])
    assert diff == 0.0 and basis.startswith("one seed")  # per iteration the last 10 would differ by 0.1
    # with seeds, the error is the spread of the paired differences: here 0, 0 and 0.03 (mean 0.01, SE 0.01)
    better = [dict(r, reward_mean=r["reward_mean"] + 0.03) for r in k1]
    diff, two_se, basis = bench.reward_verdict([k0, k0, k0], [k1, k1, better])
    assert basis == "3 seeds" and diff == pytest.approx(0.01) and two_se == pytest.approx(0.02)
    assert bench.noise_verdict(diff, two_se) == "within the noise"
    assert bench.noise_verdict(0.03, 0.02) == "k=1 higher, outside the noise"
    assert bench.noise_verdict(-0.03, 0.02) == "k=1 LOWER, outside the noise"


def _load(script: str):
    sys.path.insert(0, str(BENCH))  # the scripts import bench/_common
    spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sequence_parallel_skips_what_cannot_fit_and_reports_it():
    sp = _load("sequence_parallel.py")
    mib = sp.MIB
    rows = [
        {"length": 1024, "ac": False, "sp": 1, "act": 1000 * mib, "baseline": 1400 * mib, "step_s": 10.0},
        {"length": 1024, "ac": False, "sp": 2, "act": 520 * mib, "baseline": 1400 * mib, "step_s": 12.0},
    ]
    # Linear in L from the longest shorter pack of the same (ac, sp): 8x the activations, all ranks' baselines.
    assert sp.predicted_need(rows, 8192, False, 1) == (1400 + 8000) * mib
    assert sp.predicted_need(rows, 8192, False, 2) == 2 * (1400 + 4160) * mib
    assert sp.predicted_need(rows, 8192, True, 1) is None  # nothing measured with checkpointing yet
    rows.append({"length": 8192, "ac": False, "sp": 1, "skipped": "skipped: needs ~30 GiB, 20 GiB free"})
    report = sp._report(rows, 2048 * mib, "/m/smollm2", 1, (1.0, 1.0, 1.0))
    assert "| 8192 | off | 1 | skipped: needs ~30 GiB, 20 GiB free |" in report
    assert "0.52x at 1024 (checkpointing off)" in report  # the ratio comes from the longest pack both sp measured
