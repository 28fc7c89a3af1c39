"""Refactors change no numbers: the default run (HF engine) reproduces the metrics recorded before the redesign, and a
checkpoint written by rlpipe before the redesign (train_state.json format 1) resumes into the same rows.

`tests/golden/hf-20.json` holds the columns on which two runs of the pre-redesign code agreed to the last bit
(`scripts/golden_metrics.py record`); timings and memory are not in it. `tests/fixtures/checkpoint-format1/` is the
iteration-2 checkpoint of a 4-iteration run of that code, with the run's metrics.jsonl.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "hf-20.json"
FORMAT1 = REPO / "tests" / "fixtures" / "checkpoint-format1"

pytestmark = pytest.mark.e2e


def _golden_script():
    spec = importlib.util.spec_from_file_location("golden_metrics", REPO / "scripts" / "golden_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_run_reproduces_the_recorded_metrics(tmp_path):
    script = _golden_script()
    golden = json.loads(GOLDEN.read_text())
    assert len(golden["rows"]) == 20 and {"reward_mean", "loss", "grad_norm", "lr"} <= set(golden["columns"])
    rows = script.run_once(golden["overrides"], tmp_path)
    assert script.differences(golden, rows) == []


def test_a_format_1_checkpoint_resumes_into_the_unbroken_runs_rows(tmp_path):
    script = _golden_script()
    columns = json.loads(GOLDEN.read_text())["columns"]
    old_state = json.loads((FORMAT1 / "step-000002" / "train_state.json").read_text())
    assert "format" not in old_state and "consumed_samples" in old_state  # really the old schema
    target = tmp_path / "ckpt" / script.EXPERIMENT / "step-000002"
    shutil.copytree(FORMAT1 / "step-000002", target)
    rows = script.run_once(["iterations=4"], tmp_path, resume=True)
    unbroken = [json.loads(line) for line in (FORMAT1 / "metrics.jsonl").read_text().splitlines()]
    want = {"rows": [{k: r[k] for k in columns} for r in unbroken[2:]]}
    assert [r["iteration"] for r in rows] == [3.0, 4.0]
    assert script.differences(want, rows) == []
