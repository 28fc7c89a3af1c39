"""Flyte Decks of the train/segment tasks: training curves (plotly) and a metrics table, refreshed while running.

Why live: a segment runs for many minutes; `Deck.publish()` (flytekit >= 1.13) renders the task's decks and uploads
them to the task's output metadata while the task is still running, so the UI shows curves before it ends. Publishing
renders plotly.js into the page, so it is throttled (`publish_every_s`) and forced once at the end.
"""

from __future__ import annotations

import html
import math
import time

import pandas as pd

PANELS: dict[str, tuple[str, ...]] = {
    "Reward": ("reward_mean", "reward_max", "eval/reward_mean"),
    "KL": ("kl", "approx_kl", "mismatch/mismatch_kl"),
    "Entropy": ("train_entropy", "rollout_entropy"),
    "Loss": ("loss", "policy_loss", "kl_loss", "sft/loss"),
    "Grad norm": ("grad_norm",),
    "Clip fraction": ("clip_frac_low", "clip_frac_high", "dual_clip_frac"),
    "Throughput": ("train_tokens_per_s", "rollout_tokens_per_s"),
    "Phase time": ("rollout_time_s", "fit_time_s"),
    "Served weight version": ("engine/weight_version", "engine/weight_lag"),
    "Weight sync probe |diff|": ("engine/probe_max_abs_diff",),
}
"""Panel title -> metric keys drawn in it (keys absent from the rows are skipped; empty panels still show)."""

CURVES_DECK = "Training curves"
TABLE_DECK = "Metrics table"


def metrics_frame(rows: list[dict[str, float]]) -> pd.DataFrame:
    """Rows -> a frame indexed by iteration (union of keys, NaN where a row lacks one), columns sorted."""
    frame = pd.DataFrame(rows, dtype="float64")
    if "iteration" in frame.columns:
        frame = frame.set_index("iteration")
    return frame.reindex(sorted(frame.columns), axis=1)


def curves_html(rows: list[dict[str, float]], include_plotlyjs: bool | str = True) -> str:
    """One plotly figure, a grid of `PANELS`, as an HTML fragment (plotly.js inlined so it works offline)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    frame = metrics_frame(rows)
    titles = list(PANELS)
    ncols = 2
    nrows = math.ceil(len(titles) / ncols)
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=titles)
    for i, title in enumerate(titles):
        for key in PANELS[title]:
            if key in frame.columns and frame[key].notna().any():
                series = frame[key].dropna()
                fig.add_trace(
                    go.Scatter(x=list(series.index), y=list(series.values), mode="lines+markers", name=key),
                    row=i // ncols + 1,
                    col=i % ncols + 1,
                )
    fig.update_layout(height=260 * nrows, showlegend=True, margin={"t": 40, "b": 20})
    fig.update_xaxes(title_text="iteration")
    return fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs)


def served_html(served: list[dict]) -> str:
    """Which server served which weights (the lineage manifest's `served` entries) as an HTML table; "" for none."""
    if not served:
        return ""
    lines = [
        f"<tr><td>{html.escape(str(s['iterations']))}</td><td>{html.escape(str(s['engine']))}</td>"
        f"<td>{html.escape(_version_span(s['weight_versions']))}</td></tr>"
        for s in served
    ]
    head = "<tr><th>iterations</th><th>engine and address</th><th>weight versions served</th></tr>"
    return f"<h4>Rollout engine</h4><table border='1'>{head}{''.join(lines)}</table>"


def _version_span(versions: list[int]) -> str:
    """[3, 4, 5] -> '3..5 (3 iterations)'; -1 means never synced (engine=openai)."""
    if not versions:
        return ""
    if all(v == -1 for v in versions):
        return "never synced (off-policy)"
    return f"{versions[0]}..{versions[-1]} ({len(versions)} iterations)"


def table_html(rows: list[dict[str, float]]) -> str:
    """The metrics as an HTML table, one row per iteration (values escaped; 4 significant digits)."""
    if not rows:
        return "<p>no iterations yet</p>"
    return metrics_frame(rows).to_html(float_format=lambda v: f"{v:.4g}", escape=True, na_rep="")


class TrainingDecks:
    """Collects metrics rows and keeps the task's two decks current; safe to use outside a Flyte task (no-op)."""

    def __init__(self, title: str, publish_every_s: float = 30.0, rows: list[dict[str, float]] | None = None):
        self.title = title
        self.publish_every_s = publish_every_s
        self.rows: list[dict[str, float]] = list(rows or [])
        self.served: list[dict] = []  # the manifest's `served` entries, once a checkpoint has them
        self._last_publish = time.monotonic()  # first publish after `publish_every_s` (then at the end)

    def add(self, row: dict[str, float]) -> None:
        """Record one iteration; publish when the last publish (or the start) is older than `publish_every_s`."""
        self.rows.append(dict(row))
        if time.monotonic() - self._last_publish >= self.publish_every_s:
            self.publish()

    def render(self) -> dict[str, str]:
        """Deck name -> HTML."""
        head = f"<h3>{html.escape(self.title)}</h3>" + served_html(self.served)
        return {CURVES_DECK: head + curves_html(self.rows), TABLE_DECK: head + table_html(self.rows)}

    def publish(self) -> bool:
        """Replace our decks in the current task context and upload them now; False outside a deck-enabled task."""
        self._last_publish = time.monotonic()
        try:
            import flytekit
            from flytekit import Deck

            params = flytekit.current_context()
            if not params.enable_deck:
                return False
            decks = params.decks
        except Exception:  # noqa: BLE001 - no Flyte context (plain python, unit tests)
            return False
        rendered = self.render()
        decks[:] = [d for d in decks if getattr(d, "name", None) not in rendered]
        for name, body in rendered.items():
            decks.append(Deck(name, body, auto_add_to_deck=False))
        Deck.publish()
        return True
