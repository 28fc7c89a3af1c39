"""The decks as a user sees them: flytekit 1.16's own deck.html of a local task run, rendered by headless Chromium.

Skipped when chromium is absent, unless RLPIPE_REQUIRE_BROWSER is set (CI: `bash scripts/setup_browser.sh`), then
they fail. Screenshots go to the test's tmp dir and, when RLPIPE_ARTIFACTS is set, are copied there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.browser.cdp import Browser, find_chromium

DATA = Path(__file__).parent / "data" / "deckprobe_metrics.jsonl"
MIN_FILL = 0.9  # the figures span at least this share of their tab's content width


@pytest.fixture
def browser():
    binary = find_chromium()
    if binary is None:
        if os.environ.get("RLPIPE_REQUIRE_BROWSER"):
            pytest.fail("RLPIPE_REQUIRE_BROWSER is set but chromium is not installed: bash scripts/setup_browser.sh")
        pytest.skip("chromium not installed (bash scripts/setup_browser.sh); set RLPIPE_REQUIRE_BROWSER=1 to require")
    b = Browser(binary, width=1400, height=1000)
    yield b
    b.close()


def save_artifact(path: Path) -> None:
    """Copy a screenshot where CI keeps artifacts (RLPIPE_ARTIFACTS), if set."""
    if dest := os.environ.get("RLPIPE_ARTIFACTS"):
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(dest) / path.name)


def full_rows() -> list[dict[str, float]]:
    """A real run's rows (rlpipe run, 12 iterations, hf engine) plus the keys other configs log: reference KL, a
    synced server's engine/* metrics, SFT every 4 iterations, eval every 5, and one iteration without rollout stats
    (a gap that must stay a gap)."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    for r in rows:
        it = int(r["iteration"])
        r["kl"] = 1e-4 * it
        r["engine/weight_version"] = r["optimizer_step"] - 1.0
        r["engine/sync_time_s"] = 0.05
        r["engine/probe_max_abs_diff"] = 10.0 ** -(it % 5 + 3)
        if it % 4 == 0:
            r.update({"sft/loss": 1.0 / it, "sft/grad_norm": 2.0, "sft/lr": 1e-4, "sft/step_time_s": 0.02})
        if it % 5 == 0:
            r["eval/reward_mean"] = 0.3
    del rows[6]["reward_mean"], rows[6]["pass_at_n"]
    return rows


def write_chain(root: Path, steps: int = 3, tamper_step: int | None = None) -> Path:
    """A chain of `steps` checkpoints (step-000001 <- ... ) with real files and hashes; returns the newest."""
    from rlpipe.train.lineage import build_manifest

    parent = None
    for step in range(1, steps + 1):
        d = root / f"step-{step:06d}"
        (d / "weights").mkdir(parents=True)
        (d / "weights" / "shard.bin").write_bytes(bytes(range(step, step + 64)))
        (d / "train_state.json").write_text(json.dumps({"step": step}))
        served = [{"iterations": f"{step * 4 - 3}-{step * 4}", "engine": "vllm http://127.0.0.1:8123",
                   "weight_versions": list(range(step * 4 - 4, step * 4))}]  # fmt: skip
        data = [
            {"name": f"prompts@{step * 4 - 3}-{step * 4}", "path": str(root / "prompts.parquet"), "sha256": "ab" * 32}
        ]
        m = build_manifest(experiment="deck-test", step=step, iteration=step * 4, phase="segment", parent=parent,
                           base_model={"path": str(root / "base"), "fingerprint": "cd" * 32}, data=data, served=served,
                           config={"seed": 0}, metrics={"reward_mean": 0.1 * step, "loss": 1.0 / step})  # fmt: skip
        m.files = {
            rel: hashlib.sha256((d / rel).read_bytes()).hexdigest() for rel in ("weights/shard.bin", "train_state.json")
        }
        m.complete = True
        (d / "manifest.json").write_text(m.model_dump_json())
        parent = f"../step-{step:06d}"
    if tamper_step is not None:
        (root / f"step-{tamper_step:06d}" / "weights" / "shard.bin").write_bytes(b"changed")
    return root / f"step-{steps:06d}"


def flytekit_deck_page(monkeypatch, rows: list[dict[str, float]], checkpoint: Path) -> Path:
    """Run a deck-enabled task locally (the deck fields of rl_segment) and return the deck.html flytekit wrote."""
    from flytekit import task
    from flytekit.core.data_persistence import FileAccessProvider

    from tasks.decks import TrainingDecks
    from tasks.segment import rl_segment

    made: list[str] = []
    original = FileAccessProvider.get_random_local_directory

    def spy(self) -> str:  # flytekit's _output_deck writes <random local dir>/deck.html; note every such dir
        made.append(original(self))
        return made[-1]

    monkeypatch.setattr(FileAccessProvider, "get_random_local_directory", spy)

    @task(enable_deck=True, deck_fields=tuple(rl_segment.deck_fields))
    def fake_segment() -> int:
        decks = TrainingDecks("deck-test: segment, iterations 1..12", publish_every_s=1e9, rows=rows)
        if hasattr(decks, "set_lineage"):  # lets the curves test run against the decks before the Lineage deck
            decks.set_lineage(str(checkpoint))
        decks.publish()
        return len(decks.rows)

    assert fake_segment() == len(rows)
    pages = [Path(d) / "deck.html" for d in made if (Path(d) / "deck.html").exists()]
    assert pages, "flytekit wrote no deck.html"
    return max(pages, key=lambda p: p.stat().st_mtime_ns)


def flytekit_template_urls() -> set[str]:
    """External URLs flytekit's own deck template loads (its web font): not ours to remove."""
    import flytekit.deck.deck as deck_module

    return set(re.findall(r'href="(https?://[^"]+)"', deck_module.get_deck_template().template))


SHOW_TAB = """
NAME => new Promise(done => {
  const tab = [...document.querySelectorAll('#flyte-frame-tabs li')].find(t => t.textContent.trim() === NAME);
  tab.click();
  requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(() => {
    const idx = tab.getAttribute('link_index');
    const box = [...document.querySelectorAll('#flyte-frame-container > div')]
      .find(d => d.getAttribute('link_index') === idx);
    const cs = getComputedStyle(box);
    const inner = box.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
    const figs = [...box.querySelectorAll('svg.rl-chart, .js-plotly-plot svg.main-svg, .rl-node')]
      .map(e => e.getBoundingClientRect()).filter(r => r.width > 0);
    const panels = [...box.querySelectorAll('figure.rl-panel')].map(f => ({
      title: f.querySelector('figcaption').textContent,
      points: [...f.querySelectorAll('.rl-series')].map(s => s.tagName === 'circle' ? 1
        : s.getAttribute('points').trim().split(' ').length).reduce((a, b) => a + b, 0),
      legend: f.querySelectorAll('.rl-legend li').length,
    }));
    done({
      first_tab: document.querySelector('#flyte-frame-tabs li').textContent.trim(),
      inner, n: figs.length,
      left: Math.min(...figs.map(r => r.left)) - box.getBoundingClientRect().left - parseFloat(cs.paddingLeft),
      span: Math.max(...figs.map(r => r.right)) - Math.min(...figs.map(r => r.left)),
      panels, nodes: [...box.querySelectorAll('.rl-node')].map(n => n.textContent),
      table_scrolls: (() => { const w = box.querySelector('.rl-table-wrap');
        return w ? getComputedStyle(w).overflowX : null; })(),
    });
  }, 100)));
})
"""


def show_tab(browser: Browser, name: str) -> dict:
    return browser.evaluate(f"({SHOW_TAB})({json.dumps(name)})")


def external_requests(browser: Browser) -> list[str]:
    return [u for u in browser.requests() if not u.startswith(("file:", "data:", "about:"))]


def test_curves_fill_their_tab_in_flytekits_deck_page(browser, monkeypatch, tmp_path):
    """Flytekit opens another tab first; after switching to the curves their panels span the tab, each with data."""
    from tasks.decks import CURVES_DECK, PANELS

    page = flytekit_deck_page(monkeypatch, full_rows(), write_chain(tmp_path / "ck"))
    browser.open(page)
    m = show_tab(browser, CURVES_DECK)
    shot = browser.screenshot(tmp_path / "deck_training_curves.png")
    save_artifact(shot)
    assert m["first_tab"] != CURVES_DECK  # the curves were hidden while the page loaded
    assert m["n"] > 0 and m["span"] >= MIN_FILL * m["inner"], m
    assert abs(m["left"]) < 0.05 * m["inner"], m
    assert {p["title"] for p in m["panels"]} == set(PANELS)
    assert all(p["points"] > 0 and p["legend"] > 0 for p in m["panels"]), m["panels"]
    assert browser.js_errors() == []
    assert set(external_requests(browser)) <= flytekit_template_urls()


def test_table_and_lineage_tabs_render_offline(browser, monkeypatch, tmp_path):
    from tasks.decks import LINEAGE_DECK, TABLE_DECK

    page = flytekit_deck_page(monkeypatch, full_rows(), write_chain(tmp_path / "ck", tamper_step=2))
    browser.open(page)
    table = show_tab(browser, TABLE_DECK)
    save_artifact(browser.screenshot(tmp_path / "deck_metrics_table.png"))
    assert table["table_scrolls"] == "auto"
    lineage = show_tab(browser, LINEAGE_DECK)
    save_artifact(browser.screenshot(tmp_path / "deck_lineage.png"))
    assert len(lineage["nodes"]) == 4  # three checkpoints and the base model
    assert "verified" in lineage["nodes"][0] and "FAILED" in lineage["nodes"][1] and "base model" in lineage["nodes"][3]
    assert lineage["span"] >= 0.5 * lineage["inner"]
    assert browser.js_errors() == []
    assert set(external_requests(browser)) <= flytekit_template_urls()


def test_lineage_html_page_from_the_cli(browser, tmp_path, capsys):
    """`rlpipe lineage --format html` is a standalone page: no script, no request, every node drawn."""
    from rlpipe.cli import main

    newest = write_chain(tmp_path / "ck", steps=3)
    assert main(["lineage", str(newest), "--format", "html"]) == 0
    page = tmp_path / "lineage.html"
    page.write_text(capsys.readouterr().out)
    browser.open(page)
    m = browser.evaluate(
        "({nodes: [...document.querySelectorAll('.rl-node')].map(n => [n.textContent, n.getBoundingClientRect().height]),"
        " width: document.body.clientWidth})"
    )
    save_artifact(browser.screenshot(tmp_path / "lineage_page.png"))
    assert [t.split(" · ")[0] for t, _ in m["nodes"][:3]] == [
        "step 3 (iteration 12, segment)",
        "step 2 (iteration 8, segment)",
        "step 1 (iteration 4, segment)",
    ]
    assert all("verified" in t and "vllm http://127.0.0.1:8123" in t for t, _ in m["nodes"][:3])
    assert all(h > 0 and not math.isnan(h) for _, h in m["nodes"])
    assert browser.js_errors() == [] and external_requests(browser) == []
