"""Decks and lineage rendering without a browser: axes, gaps, smoothing, table order, CSV, page size, lineage views."""

from __future__ import annotations

import io
import json
import math
import re
from urllib.parse import unquote

import pandas as pd
import pytest

from tests.browser.test_decks_in_chromium import full_rows, write_chain


def test_y_axis_log_only_when_values_span_decades_and_flat_series_get_a_sane_range():
    from tasks.decks import y_axis

    assert y_axis([1e-7, 1e-3]).log and not y_axis([1.0, 50.0]).log
    assert not y_axis([-1e-8, 1e-3]).log  # a non-positive value rules log out
    noise = y_axis([4e-8, -4e-8, 1e-8], min_span=0.01)  # rollout mismatch noise must look flat, not wild
    assert noise.hi - noise.lo >= 0.01 and noise.lo < 0 < noise.hi
    zero = y_axis([0.0, 0.0], min_span=0.01)  # a constant non-negative fraction starts at 0
    assert zero.ticks[0] == 0.0 and zero.hi >= 0.01 and zero.lo > -0.001
    const = y_axis([5.0, 5.0])
    assert const.lo < 5.0 < const.hi


def test_gaps_stay_gaps_and_ema_skips_them():
    from tasks.decks import _runs, ema

    nan = math.nan
    assert _runs([1, 2, 3, 4, 5], [1.0, 2.0, nan, 4.0, 5.0]) == [[(1, 1.0), (2, 2.0)], [(4, 4.0), (5, 5.0)]]
    smoothed = ema([1.0, nan, 3.0])
    assert smoothed[0] == 1.0 and math.isnan(smoothed[1]) and 1.0 < smoothed[2] < 3.0


def test_curves_split_kl_families_and_show_lag_for_a_synced_engine():
    from tasks.decks import curves_html

    page = curves_html(full_rows())
    panels = dict(re.findall(r"<figcaption>(.*?)</figcaption>(.*?)</figure>", page))
    assert 'data-key="approx_kl"' in panels["Policy KL (approx_kl, old vs new)"]
    assert 'data-key="kl"' in panels["Reference KL"] and "approx_kl" not in panels["Reference KL"]
    assert 'data-key="mismatch/mismatch_kl"' in panels["Rollout vs trainer mismatch"]
    assert "(log scale)" in panels["Weight sync probe |diff|"]
    # vllm rows have engine/weight_version but no engine/weight_lag: the lag is derived (0 for a synced engine)
    assert 'data-key="engine/weight_lag_derived"' in panels["Served-weight lag"]
    assert "Not recorded" not in page
    # iteration 7 has no reward_mean: its line breaks there (two polylines, raw and smoothed each)
    assert panels["Reward"].count('class="rl-series" data-key="reward_mean"') == 2
    assert panels["Reward"].count('class="rl-raw"') == 2


def test_derived_lag_counts_steps_behind():
    from tasks.decks import _with_derived, metrics_frame

    rows = [{"iteration": float(i), "optimizer_step": float(i), "engine/weight_version": float(max(i - 2, 0))}
            for i in range(1, 5)]  # fmt: skip
    lag = _with_derived(metrics_frame(rows))["engine/weight_lag_derived"].tolist()
    assert lag == [0.0, 1.0, 1.0, 1.0]


def test_default_run_notes_panels_it_has_no_metric_for():
    from tasks.decks import curves_html

    rows = [{"iteration": 1.0, "reward_mean": 0.5}, {"iteration": 2.0, "reward_mean": 0.6}]
    page = curves_html(rows)
    assert "Not recorded in this run:" in page and "Served-weight lag" in page.split("Not recorded")[1]


def test_table_puts_key_columns_first_groups_prefixes_and_prints_integer_iterations():
    from tasks.decks import column_order, table_html

    cols = ["zeta", "mismatch/b", "iteration", "lr", "alpha", "mismatch/a", "reward_mean", "eval/reward_mean"]
    assert column_order(cols) == [
        "iteration", "reward_mean", "eval/reward_mean", "lr", "alpha", "zeta", "mismatch/a", "mismatch/b",
    ]  # fmt: skip
    page = table_html([{"iteration": 3.0, "loss": 0.5}])
    assert "<td>3</td>" in page and "<td>3.0</td>" not in page and "position:sticky" in page


def test_csv_link_carries_every_row():
    from tasks.decks import table_html

    rows = full_rows()
    page = table_html(rows)
    data = re.search(r'href="data:text/csv;charset=utf-8,([^"]+)"', page).group(1)
    frame = pd.read_csv(io.StringIO(unquote(data)))
    assert (
        len(frame) == len(rows)
        and frame.columns[0] == "iteration"
        and frame["loss"].iloc[0] == pytest.approx(rows[0]["loss"], rel=1e-7)
    )


def test_a_400_iteration_deck_page_stays_under_1_mb():
    """The whole page flytekit uploads for a segment (curves + table + template), 400 iterations x ~60 metrics."""
    from tasks.decks import TrainingDecks

    base = full_rows()
    rows = [{**base[i % len(base)], "iteration": float(i + 1), "optimizer_step": float(i + 1)} for i in range(400)]
    pages = TrainingDecks("size", rows=rows).render()
    assert sum(len(p.encode()) for p in pages.values()) < 1_000_000


def test_lineage_text_shows_served_weights_data_verification_and_a_metrics_table(tmp_path):
    from rlpipe.lineage_view import render_lineage

    text = render_lineage(str(write_chain(tmp_path, steps=2, tamper_step=1)), "text")
    assert "step 2 (iteration 8, segment)  [verified: 2 files match their sha256]" in text
    assert "[FAILED: hash differs: weights/shard.bin]" in text
    assert "served:  iterations 5-8 by vllm http://127.0.0.1:8123: weights 4..7" in text
    assert f"prompts@1-4: {tmp_path / 'prompts.parquet'}" in text and "base model:" in text
    table = text.split("metrics (--format json for all):\n")[1].splitlines()
    assert table[0].split() == ["step", "iter", "reward_mean", "loss"] and table[1].split()[:2] == ["2", "8"]


def test_lineage_missing_file_fails_and_budget_skips(tmp_path):
    from rlpipe.lineage_view import verify_chain
    from rlpipe.train.lineage import lineage_chain

    newest = write_chain(tmp_path, steps=2)
    (newest / "train_state.json").unlink()
    checks = verify_chain(lineage_chain(newest))
    assert checks[0].status == "FAILED" and "missing: train_state.json" in checks[0].detail
    assert checks[1].status == "verified"
    assert {c.status for c in verify_chain(lineage_chain(newest), max_bytes=10)} == {"not checked"}


@pytest.mark.parametrize("fmt", ["mermaid", "dot", "html", "json", "text"])
def test_lineage_cli_formats(tmp_path, capsys, fmt):
    from rlpipe.cli import main

    newest = write_chain(tmp_path, steps=2)
    assert main(["lineage", str(newest), "--format", fmt]) == 0
    out = capsys.readouterr().out
    if fmt == "mermaid":
        assert out.startswith("flowchart TD") and "c0 -->|parent| c1" in out and "c1 -->|parent| base" in out
    elif fmt == "dot":
        assert out.startswith("digraph lineage {") and "c1 -> base" in out and out.rstrip().endswith("}")
    elif fmt == "html":
        assert out.count('class="rl-node') == 3 and "<script" not in out and "http" not in out.replace("http://127", "")
    elif fmt == "json":
        assert len(json.loads(out)["chain"]) == 2
    else:
        assert "verified" in out and "weights 0..3" in out
