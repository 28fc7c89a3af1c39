"""Flyte Decks of the train/segment tasks: training curves, a metrics table and the lineage, refreshed while running.

Why live: a segment runs for many minutes; `Deck.publish()` (flytekit >= 1.13) renders the task's decks and uploads
them to the task's output metadata while the task is still running, so the UI shows curves before it ends.

Why hand-drawn SVG and not plotly: plotly.js is ~4.6 MB per page (a segment re-uploaded it every minute, a granular
run once per task), and flytekit opens its Timeline tab first, so plotly drew the hidden curves at its 700 px
fallback. An inline SVG per panel scales with its CSS grid cell whatever tab was open when it was drawn, needs no
script or network, and a page is tens of kB (sizes in docs/FLYTE.md).
"""

from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass, field
from urllib.parse import quote

import pandas as pd

CURVES_DECK = "Training curves"
TABLE_DECK = "Metrics table"
LINEAGE_DECK = "Lineage"

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
SVG_W, SVG_H = 480, 230  # viewBox; the SVG itself is 100% of its grid cell wide
PAD_L, PAD_R, PAD_T, PAD_B = 62, 12, 10, 34
EMA_WEIGHT = 0.6  # TensorBoard's default smoothing
SMOOTH_MIN_POINTS = 8  # below this a smoothed line says nothing the raw one does not
LOG_DECADES = 2.0  # log scale once the positive values of a panel span this many decades


@dataclass(frozen=True)
class Panel:
    """One chart: metric keys of one measure family, sharing a y unit."""

    unit: str
    keys: tuple[str, ...]
    smooth: bool = False  # draw an EMA over a faint raw line
    min_span: float = 0.0  # y axis at least this tall (numerical noise stays flat)
    band: tuple[str, str] | None = None  # derived (lo, hi) columns drawn as a shaded band
    labels: dict[str, str] = field(default_factory=dict)


PANELS: dict[str, Panel] = {
    "Reward": Panel(
        "reward (mean over samples)",
        ("reward_mean", "eval/reward_mean"),
        smooth=True,
        band=("reward_lo", "reward_hi"),
        labels={"eval/reward_mean": "eval/reward_mean (greedy, held out)"},
    ),
    "pass@n and best reward": Panel("fraction of prompts", ("pass_at_n", "reward_max"), min_span=0.05),
    "Response length": Panel("tokens per response", ("response_length_mean",), smooth=True),
    "Truncated responses": Panel("fraction of responses", ("truncated_fraction",), min_span=0.05),
    "Zero-advantage groups": Panel(
        "fraction of groups",
        ("uniform_group_fraction",),
        min_span=0.05,
        labels={"uniform_group_fraction": "uniform_group_fraction (all rewards equal)"},
    ),
    "Learning rate": Panel("lr", ("lr", "sft/lr")),
    "Entropy": Panel("nats / token", ("train_entropy", "rollout_entropy"), smooth=True),
    "Policy KL (approx_kl, old vs new)": Panel("nats / token", ("approx_kl",), smooth=True, min_span=1e-3),
    "Reference KL": Panel("nats / token", ("kl", "kl_loss"), smooth=True, min_span=1e-3),
    "Rollout vs trainer mismatch": Panel(
        "nats / token", ("mismatch/mismatch_kl", "mismatch/mismatch_k3_kl"), min_span=0.01
    ),
    "Loss": Panel("loss", ("loss", "policy_loss", "sft/loss"), smooth=True),
    "Clip fractions": Panel("fraction of tokens", ("clip_frac_low", "clip_frac_high", "dual_clip_frac"), min_span=0.01),
    "Grad norm": Panel("L2 norm (before clipping)", ("grad_norm", "sft/grad_norm"), smooth=True),
    "Iteration time": Panel(
        "seconds",
        ("iteration_time_s", "rollout_time_s", "engine/sync_time_s", "fit_time_s", "sft/step_time_s"),
        labels={
            "iteration_time_s": "iteration (total)",
            "rollout_time_s": "rollout (incl. weight sync)",
            "engine/sync_time_s": "weight sync",
            "fit_time_s": "train (incl. logprobs)",
            "sft/step_time_s": "SFT step",
        },
    ),
    "Memory": Panel("MB (peak, per rank)", ("peak_memory_mb",)),
    "Trainer throughput": Panel("tokens / s", ("train_tokens_per_s",)),
    "Rollout throughput": Panel("tokens / s", ("rollout_tokens_per_s",)),
    "Served-weight lag": Panel(
        "optimizer steps behind",
        ("engine/weight_lag", "engine/weight_lag_derived"),
        min_span=1.0,
        labels={"engine/weight_lag_derived": "lag (policy step at rollout - engine/weight_version)"},
    ),
    "Weight sync probe |diff|": Panel("max |logprob diff|", ("engine/probe_max_abs_diff",)),
}
"""Panel title -> what it draws. A panel none of whose keys any row has is left out and named in a note."""

KEY_COLUMNS = (
    "iteration",
    "reward_mean",
    "pass_at_n",
    "eval/reward_mean",
    "response_length_mean",
    "truncated_fraction",
    "uniform_group_fraction",
    "loss",
    "kl",
    "approx_kl",
    "grad_norm",
    "lr",
    "iteration_time_s",
)
"""Columns the table shows first, in this order; the rest follow grouped by prefix."""

STYLE = """<style>
.rl-deck{font-family:Open Sans,helvetica,arial,sans-serif;color:#222}
.rl-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:12px;width:100%}
.rl-panel{margin:0;border:1px solid #ddd;border-radius:4px;padding:6px 8px;min-width:0}
.rl-panel figcaption{font-weight:700;font-size:14px}
.rl-panel svg{display:block;width:100%;height:auto}
.rl-legend{list-style:none;margin:2px 0 0;padding:0;font-size:12px;display:flex;flex-wrap:wrap;gap:2px 12px}
.rl-legend i{display:inline-block;width:14px;height:3px;margin-right:4px;vertical-align:middle}
.rl-note{font-size:12px;color:#666}
.rl-table-wrap{overflow:auto;max-height:75vh;max-width:100%;border:1px solid #ddd}
.rl-table{border-collapse:collapse;font-size:12px;white-space:nowrap}
.rl-table th,.rl-table td{padding:2px 6px;border-right:1px solid #eee;text-align:right}
.rl-table thead th{position:sticky;top:0;background:#f4f4f8;z-index:1;vertical-align:bottom}
.rl-table th:first-child,.rl-table td:first-child{position:sticky;left:0;background:#f4f4f8;z-index:2}
.rl-table .g{display:block;font-weight:400;color:#888}
.rl-table tbody tr:nth-child(even) td{background:#fafafa}
</style>"""


def metrics_frame(rows: list[dict[str, float]]) -> pd.DataFrame:
    """Rows -> a frame indexed by iteration (union of keys, NaN where a row lacks one), columns sorted."""
    frame = pd.DataFrame(rows, dtype="float64")
    if "iteration" in frame.columns:
        frame = frame.set_index("iteration")
    return frame.reindex(sorted(frame.columns), axis=1)


def _with_derived(frame: pd.DataFrame) -> pd.DataFrame:
    """Columns the panels draw that rows do not carry: the reward band and the served-weight lag of synced engines."""
    out = frame.copy()
    if "reward_min" in out.columns and "reward_max" in out.columns:
        out["reward_lo"], out["reward_hi"] = out["reward_min"], out["reward_max"]
    elif "reward_mean" in out.columns and "reward_std" in out.columns:
        out["reward_lo"] = out["reward_mean"] - out["reward_std"]
        out["reward_hi"] = out["reward_mean"] + out["reward_std"]
    if "engine/weight_version" in out.columns and "optimizer_step" in out.columns:
        served = out["engine/weight_version"].where(out["engine/weight_version"] >= 0)
        at_rollout = out["optimizer_step"].shift(1)  # the policy's step when this iteration's rollout began
        if len(out.index) and out.index[0] == 1:
            at_rollout.iloc[0] = 0.0
        lag = at_rollout - served
        if "engine/weight_lag" in out.columns:
            lag = lag.where(out["engine/weight_lag"].isna())
        out["engine/weight_lag_derived"] = lag
    return out


def ema(values: list[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Debiased exponential moving average that skips NaNs (a gap stays a gap, the state carries over it)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if math.isnan(v):
            out.append(math.nan)
            continue
        acc, norm = weight * acc + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(acc / norm)
    return out


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps)."""
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


@dataclass
class Axis:
    """A y axis: range, scale and ticks."""

    lo: float
    hi: float
    log: bool
    ticks: list[float]

    def frac(self, v: float) -> float:
        """Position of `v` in [0, 1] from bottom to top."""
        if self.log:
            return (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        return (v - self.lo) / (self.hi - self.lo)


def y_axis(values: list[float], min_span: float = 0.0) -> Axis:
    """Log when positive values span >= LOG_DECADES decades; else linear, at least `min_span` tall, never zero."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = min(finite), max(finite)
    if lo > 0 and math.log10(hi / lo) >= LOG_DECADES:
        lo_e, hi_e = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        step = max(1, math.ceil((hi_e - lo_e) / 6))
        return Axis(10.0**lo_e, 10.0**hi_e, True, [10.0**e for e in range(lo_e, hi_e + 1, step)])
    span = max(hi - lo, min_span, abs(hi) * 0.05, 1e-12)
    mid = (hi + lo) / 2
    if hi - lo < span:  # grow a flat or noise-only series symmetric around it (non-negative data stays >= 0)
        lo, hi = mid - span / 2, mid + span / 2
        if min(finite) >= 0 > lo:
            lo, hi = 0.0, span
    pad = (hi - lo) * 0.05
    ticks = nice_ticks(lo - pad, hi + pad)
    return Axis(min(ticks[0], lo - pad), max(ticks[-1], hi + pad), False, ticks)


def _fmt(v: float) -> str:
    """Tick label: 3 significant digits; thousands as k and millions as M (tokens/s reads 85k, not 8.5e+04)."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(v) >= 10 * scale:
            return f"{v / scale:.3g}{suffix}"
    return "0" if v == 0 else f"{v:.3g}"


class _Plot:
    """Coordinates of one panel's plotting area."""

    def __init__(self, xs: list[float], axis: Axis):
        self.x0, self.x1 = (xs[0] - 0.5, xs[0] + 0.5) if xs[0] == xs[-1] else (xs[0], xs[-1])
        self.axis = axis

    def px(self, x: float) -> float:
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * (SVG_W - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        return SVG_H - PAD_B - self.axis.frac(y) * (SVG_H - PAD_T - PAD_B)


def _runs(xs: list[float], ys: list[float]) -> list[list[tuple[float, float]]]:
    """Consecutive non-NaN points: a missing value breaks the line (gaps are shown, never bridged)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys, strict=True):
        if math.isfinite(y):
            runs[-1].append((x, y))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _line(plot: _Plot, xs: list[float], ys: list[float], color: str, attrs: str) -> str:
    """Polylines for the runs of a series; lone points as dots (a sparse metric, e.g. eval every N iterations)."""
    parts = []
    for run in _runs(xs, ys):
        pts = " ".join(f"{plot.px(x):.1f},{plot.py(y):.1f}" for x, y in run)
        if len(run) == 1:
            x, y = run[0]
            parts.append(f'<circle cx="{plot.px(x):.1f}" cy="{plot.py(y):.1f}" r="2.5" fill="{color}" {attrs}/>')
        else:
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.6" {attrs}/>')
    return "".join(parts)


def _band(plot: _Plot, xs: list[float], lo: list[float], hi: list[float]) -> str:
    """Shaded region between two series (per run of points where both exist)."""
    out = []
    pairs = [(x, a, b) for x, a, b in zip(xs, lo, hi, strict=True)]
    for run in _runs(xs, [a + b for _, a, b in pairs]):
        keep = {x for x, _ in run}
        sel = [(x, a, b) for x, a, b in pairs if x in keep]
        top = " ".join(f"{plot.px(x):.1f},{plot.py(b):.1f}" for x, _, b in sel)
        bottom = " ".join(f"{plot.px(x):.1f},{plot.py(a):.1f}" for x, a, _ in reversed(sel))
        out.append(f'<polygon class="rl-band" points="{top} {bottom}" fill="#1f77b4" fill-opacity="0.12"/>')
    return "".join(out)


def _axes(plot: _Plot, unit: str) -> str:
    """Grid lines, tick labels, axis titles."""
    a, out = plot.axis, []
    left, right, bottom = PAD_L, SVG_W - PAD_R, SVG_H - PAD_B
    for t in a.ticks:
        if a.lo <= t <= a.hi:
            y = plot.py(t)
            out.append(f'<line x1="{left}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    lo_x, hi_x = math.ceil(plot.x0), math.floor(plot.x1)
    for t in nice_ticks(lo_x, max(hi_x, lo_x + 1), 6) if hi_x > lo_x else [lo_x]:
        if t == int(t) and plot.x0 <= t <= plot.x1:
            x = plot.px(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#888"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{int(t)}</text>')
    out.append(f'<path d="M{left},{PAD_T}V{bottom}H{right}" fill="none" stroke="#888"/>')
    out.append(f'<text x="{(left + right) / 2}" y="{SVG_H - 4}" text-anchor="middle">iteration</text>')
    label = html.escape(unit + (" (log scale)" if a.log else ""))
    mid = (PAD_T + bottom) / 2
    out.append(f'<text transform="translate(12,{mid}) rotate(-90)" text-anchor="middle">{label}</text>')
    return "".join(out)


def panel_svg(title: str, panel: Panel, frame: pd.DataFrame) -> str:
    """One <figure>: the chart (SVG) and its own legend; "" when no row has any of the panel's keys."""
    keys = [k for k in panel.keys if k in frame.columns and frame[k].notna().any()]
    if not keys:
        return ""
    xs = [float(x) for x in frame.index]
    band = panel.band if panel.band and all(c in frame.columns for c in panel.band) else None
    values = [v for k in (*keys, *(band or ())) for v in frame[k].tolist()]
    axis = y_axis(values, panel.min_span)
    if axis.log:  # a log axis cannot place values <= 0: they become gaps
        frame = frame.where(frame > 0)
    plot = _Plot(xs, axis)
    body = [_axes(plot, panel.unit)]
    if band:
        body.append(_band(plot, xs, frame[band[0]].tolist(), frame[band[1]].tolist()))
    legend = []
    for i, key in enumerate(keys):
        color, ys = PALETTE[i % len(PALETTE)], frame[key].tolist()
        smooth = panel.smooth and sum(math.isfinite(y) for y in ys) >= SMOOTH_MIN_POINTS
        if smooth:
            body.append(_line(plot, xs, ys, color, 'stroke-opacity="0.3" fill-opacity="0.3" class="rl-raw"'))
            ys = ema(ys)
        body.append(_line(plot, xs, ys, color, f'class="rl-series" data-key="{html.escape(key)}"'))
        name = html.escape(panel.labels.get(key, key)) + (" (EMA; raw faint)" if smooth else "")
        legend.append(f'<li data-key="{html.escape(key)}"><i style="background:{color}"></i>{name}</li>')
    if band:
        legend.append(
            '<li><i style="background:#1f77b4;opacity:.25;height:8px"></i>reward band (min..max or ±1 std)</li>'
        )
    svg = (
        f'<svg viewBox="0 0 {SVG_W} {SVG_H}" class="rl-chart" font-size="11" role="img" '
        f'aria-label="{html.escape(title)}">{"".join(body)}</svg>'
    )
    return (
        f'<figure class="rl-panel"><figcaption>{html.escape(title)}</figcaption>{svg}'
        f'<ul class="rl-legend">{"".join(legend)}</ul></figure>'
    )


def curves_html(rows: list[dict[str, float]]) -> str:
    """The panels as an HTML fragment (inline SVG, no script)."""
    if not rows:
        return STYLE + '<div class="rl-deck"><p>no iterations yet</p></div>'
    frame = _with_derived(metrics_frame(rows))
    figures = {title: panel_svg(title, panel, frame) for title, panel in PANELS.items()}
    missing = [html.escape(t) for t, f in figures.items() if not f]
    note = f'<p class="rl-note">Not recorded in this run: {", ".join(missing)}.</p>' if missing else ""
    body = "".join(f for f in figures.values() if f)
    return f'{STYLE}<div class="rl-deck"><div class="rl-grid">{body}</div>{note}</div>'


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


def column_order(columns: list[str]) -> list[str]:
    """`KEY_COLUMNS` first, then the rest grouped by prefix (no prefix first), alphabetical within a group."""
    first = [c for c in KEY_COLUMNS if c in columns]
    rest = sorted((c for c in columns if c not in first), key=lambda c: (c.count("/") > 0, c.rsplit("/", 1)[0], c))
    return first + rest


def _cell(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.4g}"


def csv_link(frame: pd.DataFrame) -> str:
    """A download link carrying the rows as CSV in a data: URI (works offline, no server); percent-encoded, not
    base64: a CSV is mostly digits and commas, so this is ~1.05x its size instead of 1.33x."""
    data = quote(frame.to_csv(index=False, float_format="%.8g"), safe=",.-_")
    return f'<a download="metrics.csv" href="data:text/csv;charset=utf-8,{data}">Download CSV ({len(frame)} rows)</a>'


def table_html(rows: list[dict[str, float]]) -> str:
    """The metrics, one row per iteration: key columns first, groups by prefix, sticky header, scrolls in place."""
    if not rows:
        return "<p>no iterations yet</p>"
    frame = metrics_frame(rows).reset_index()
    cols = column_order(list(frame.columns))
    frame = frame[cols]
    head = "".join(_th(c) for c in cols)
    body = []
    for rec in frame.itertuples(index=False):
        cells = [f"<td>{int(v)}</td>" if c == "iteration" and math.isfinite(v) else f"<td>{_cell(v)}</td>"
                 for c, v in zip(cols, rec, strict=True)]  # fmt: skip
        body.append(f"<tr>{''.join(cells)}</tr>")
    table = f'<table class="rl-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return f'{STYLE}<p>{csv_link(frame)}</p><div class="rl-table-wrap">{table}</div>'


def _th(column: str) -> str:
    """Header cell: the prefix (group) small above the name."""
    if "/" not in column:
        return f"<th>{html.escape(column)}</th>"
    group, name = column.rsplit("/", 1)
    return f'<th title="{html.escape(column)}"><span class="g">{html.escape(group)}/</span>{html.escape(name)}</th>'


class TrainingDecks:
    """Collects metrics rows and keeps the task's decks current; safe to use outside a Flyte task (no-op)."""

    def __init__(self, title: str, publish_every_s: float = 30.0, rows: list[dict[str, float]] | None = None):
        self.title = title
        self.publish_every_s = publish_every_s
        self.rows: list[dict[str, float]] = list(rows or [])
        self.served: list[dict] = []  # the manifest's `served` entries, once a checkpoint has them
        self.lineage: str = ""  # the Lineage deck's HTML, once a checkpoint exists (set_lineage)
        self._last_publish = time.monotonic()  # first publish after `publish_every_s` (then at the end)

    def add(self, row: dict[str, float]) -> None:
        """Record one iteration; publish when the last publish (or the start) is older than `publish_every_s`."""
        self.rows.append(dict(row))
        if time.monotonic() - self._last_publish >= self.publish_every_s:
            self.publish()

    def set_lineage(self, checkpoint: str) -> None:
        """Draw the lineage of `checkpoint` (path or URI) into the Lineage deck; a broken chain shows the error."""
        from rlpipe.errors import RlpipeError
        from rlpipe.lineage_view import DECK_VERIFY_BYTES, lineage_fragment

        try:
            self.lineage = lineage_fragment(checkpoint, verify_max_bytes=DECK_VERIFY_BYTES)
        except (RlpipeError, OSError) as exc:  # a deck must never fail the task
            self.lineage = f"<p>lineage of {html.escape(checkpoint)} unavailable: {html.escape(str(exc))}</p>"

    def render(self) -> dict[str, str]:
        """Deck name -> HTML."""
        head = f"<h3>{html.escape(self.title)}</h3>" + served_html(self.served)
        out = {CURVES_DECK: head + curves_html(self.rows), TABLE_DECK: head + table_html(self.rows)}
        if self.lineage:
            out[LINEAGE_DECK] = self.lineage
        return out

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
