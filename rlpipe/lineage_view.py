"""Lineage a user can browse: a checkpoint's chain drawn as HTML (page or Flyte deck), mermaid, dot or readable text.

Open-source Flyte has no artifact lineage UI, so this is the view: checkpoint -> parent -> ... -> base model, with
the data each step read (paths and hashes), config and code hashes, which weights each rollout engine served for
which iterations, and whether every file a manifest lists still has its recorded sha256. Reads manifests only
through `rlpipe.train.lineage`'s public API; no flytekit here (tasks/decks.py wraps the fragment in a Deck).
"""

from __future__ import annotations

import hashlib
import html
import math
import os
import posixpath
from dataclasses import dataclass

from rlpipe.train.lineage import LineageChain, LineageEntry, Manifest, lineage_chain

FORMATS = ("text", "html", "mermaid", "dot")
DECK_VERIFY_BYTES = 1 << 30
"""A deck re-hashes at most this many bytes (a task must not spend minutes reading a 7B chain back); the CLI: all."""

KEY_METRICS = ("reward_mean", "pass_at_n", "loss", "kl", "approx_kl", "grad_norm", "lr", "iteration_time_s")
_CHUNK = 1 << 20


@dataclass
class Verification:
    """Outcome of re-hashing one checkpoint's listed files."""

    status: str  # "verified", "FAILED", "not checked"
    detail: str

    @property
    def ok(self) -> bool | None:
        return {"verified": True, "FAILED": False}.get(self.status)


def _join(location: str, rel: str) -> str:
    return f"{location.rstrip('/')}/{rel}" if "://" in location else os.path.join(location, rel)


def _size_or_none(loc: str) -> int | None:
    """Bytes of a local file or fsspec URI; None when it does not exist."""
    try:
        if "://" in loc:
            import fsspec

            fs, path = fsspec.core.url_to_fs(loc)
            return int(fs.size(path))
        return os.path.getsize(loc)
    except FileNotFoundError:
        return None


def _digest(loc: str) -> str:
    """sha256 of a local file or fsspec URI, streamed."""
    h = hashlib.sha256()
    if "://" in loc:
        import fsspec

        opener = fsspec.open(loc, "rb")
    else:
        opener = open(loc, "rb")  # noqa: SIM115 - closed by the with below
    with opener as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_entry(entry: LineageEntry, budget: list[float]) -> Verification:
    """Re-hash the files the manifest lists; `budget` ([bytes left]) is spent across a chain, then we stop checking."""
    files = entry.manifest.files
    if not files:
        return Verification("not checked", "the manifest lists no files")
    sizes = {rel: _size_or_none(_join(entry.location, rel)) for rel in files}
    if sum(s or 0 for s in sizes.values()) > budget[0]:
        return Verification("not checked", "over the deck's hashing budget; run `rlpipe lineage --format html`")
    budget[0] -= sum(s or 0 for s in sizes.values())
    missing = [rel for rel in sorted(files) if sizes[rel] is None]
    mismatched = [
        rel for rel in sorted(files) if sizes[rel] is not None and _digest(_join(entry.location, rel)) != files[rel]
    ]
    problems = [
        f"{what}: {', '.join(rels)}" for what, rels in (("missing", missing), ("hash differs", mismatched)) if rels
    ]
    if problems:
        return Verification("FAILED", "; ".join(problems))
    return Verification("verified", f"{len(files)} files match their sha256")


def verify_chain(chain: LineageChain, max_bytes: float | None = None) -> list[Verification]:
    """One Verification per entry (newest first); None = no byte limit."""
    budget = [math.inf if max_bytes is None else float(max_bytes)]
    return [verify_entry(e, budget) for e in chain.entries]


def _short(h: str | None, n: int = 12) -> str:
    return "-" if not h else h[:n]


def _code(m: Manifest) -> str:
    return m.code_version.rlpipe + (f" @ {_short(m.code_version.git_commit)}" if m.code_version.git_commit else "")


def _versions(versions: list[int]) -> str:
    """[3, 4, 5] -> 'weights 3..5'; all -1 -> never synced (engine=openai serves its start-up weights)."""
    if not versions:
        return "no weights recorded"
    if all(v == -1 for v in versions):
        return "never synced (off-policy)"
    return f"weights {min(versions)}..{max(versions)}" if len(set(versions)) > 1 else f"weights {versions[0]}"


def _title(m: Manifest) -> str:
    phase = f", {m.phase}" if m.phase else ""
    return f"step {m.step} (iteration {m.iteration}{phase})" + ("" if m.complete else " INCOMPLETE")


# ------------------------------------------------------------------------------------------------------------ text


def lineage_text(chain: LineageChain, checks: list[Verification]) -> str:
    """One block per checkpoint (newest first) down to the base model, then a short metrics table."""
    blocks = []
    for e, v in zip(chain.entries, checks, strict=True):
        m = e.manifest
        lines = [
            f"{_title(m)}  [{v.status}: {v.detail}]",
            f"  path:    {e.location}",
            f"  parent:  {m.parent or '- (starts from the base model)'}"
            + (" (weights only: checkpoint.init_from)" if m.parent_weights_only else ""),
            f"  config:  {_short(m.config_hash)}    code: {_code(m)}    created: {m.created_at}",
        ]
        lines += [f"  data:    {d.name}: {d.path} (sha256 {_short(d.sha256)})" for d in m.data]
        lines += [
            f"  served:  iterations {s.iterations} by {s.engine}: {_versions(s.weight_versions)}" for s in m.served
        ]
        blocks.append("\n".join(lines))
    base = chain.entries[-1].manifest.base_model
    blocks.append(f"base model: {base.path} (fingerprint {_short(base.fingerprint)})")
    if chain.note:
        blocks.append(f"(chain ends early: {chain.note})")
    table = metrics_table_text(chain)
    return "\n   |\n   v\n".join(blocks) + ("\n\n" + table if table else "") + "\n"


def metrics_table_text(chain: LineageChain) -> str:
    """`KEY_METRICS` present in any manifest, one row per checkpoint; "" when none has metrics."""
    cols = [k for k in KEY_METRICS if any(k in m.metrics for m in chain)]
    if not cols:
        return ""
    rows = [["step", "iter", *cols]]
    rows += [[str(m.step), str(m.iteration), *(f"{m.metrics[k]:.4g}" if k in m.metrics else "-" for k in cols)]
             for m in chain]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "metrics (--format json for all):\n" + "\n".join(out)


# ------------------------------------------------------------------------------------------------- mermaid and dot


def _node_label(e: LineageEntry, v: Verification) -> str:
    m = e.manifest
    return (
        f"{_title(m)}\\n{posixpath.basename(e.location.rstrip('/'))}\\nconfig {_short(m.config_hash, 8)} · {v.status}"
    )


def lineage_mermaid(chain: LineageChain, checks: list[Verification]) -> str:
    """A mermaid flowchart: checkpoints -> parents -> base model, data and served engines as side nodes."""
    out = ["flowchart TD"]

    def q(s: str) -> str:
        return '"' + s.replace('"', "'") + '"'

    for i, (e, v) in enumerate(zip(chain.entries, checks, strict=True)):
        out.append(f"  c{i}[{q(_node_label(e, v).replace(chr(92) + 'n', '<br/>'))}]")
        nxt = f"c{i + 1}" if i + 1 < len(chain.entries) else "base"
        out.append(f"  c{i} -->|parent| {nxt}")
        for j, d in enumerate(e.manifest.data):
            out.append(f"  d{i}_{j}[({q(f'{d.name}<br/>{posixpath.basename(d.path)} {_short(d.sha256, 8)}')})]")
            out.append(f"  d{i}_{j} -.->|data| c{i}")
        for j, s in enumerate(e.manifest.served):
            out.append(f"  s{i}_{j}>{q(f'{s.engine}<br/>iterations {s.iterations}: {_versions(s.weight_versions)}')}]")
            out.append(f"  s{i}_{j} -.->|served| c{i}")
    base = chain.entries[-1].manifest.base_model
    out.append(f"  base[({q(f'base model<br/>{base.path}<br/>fingerprint {_short(base.fingerprint, 8)}')})]")
    return "\n".join(out) + "\n"


def lineage_dot(chain: LineageChain, checks: list[Verification]) -> str:
    """The same graph in Graphviz dot (`dot -Tsvg`)."""

    def q(s: str) -> str:
        return '"' + s.replace('"', '\\"') + '"'

    out = ["digraph lineage {", "  rankdir=TB; node [shape=box, fontname=Helvetica];"]
    for i, (e, v) in enumerate(zip(chain.entries, checks, strict=True)):
        color = {"verified": "darkgreen", "FAILED": "red"}.get(v.status, "gray")
        out.append(f"  c{i} [label={q(_node_label(e, v))}, color={color}];")
        out.append(f'  c{i} -> {f"c{i + 1}" if i + 1 < len(chain.entries) else "base"} [label="parent"];')
        for j, d in enumerate(e.manifest.data):
            label = f"{d.name}\\n{d.path}\\nsha256 {_short(d.sha256)}"
            out.append(f"  d{i}_{j} [shape=cylinder, label={q(label)}]; d{i}_{j} -> c{i} [style=dashed];")
        for j, s in enumerate(e.manifest.served):
            label = f"{s.engine}\\niterations {s.iterations}: {_versions(s.weight_versions)}"
            out.append(f"  s{i}_{j} [shape=note, label={q(label)}]; s{i}_{j} -> c{i} [style=dotted];")
    base = chain.entries[-1].manifest.base_model
    label = "base model\\n" + base.path
    out.append(f"  base [shape=box3d, label={q(label)}];")
    return "\n".join(out) + "\n}\n"


# ------------------------------------------------------------------------------------------------------------ html

STYLE = """<style>
.rl-lineage{font-family:Open Sans,helvetica,arial,sans-serif;font-size:13px;color:#222;max-width:1100px}
.rl-node{border:2px solid #888;border-radius:6px;padding:8px 12px;margin:0;background:#fff}
.rl-node.ok{border-color:#2ca02c}.rl-node.bad{border-color:#d62728;background:#fff5f5}
.rl-node h4{margin:0 0 4px;font-size:15px}
.rl-node table{border-collapse:collapse}.rl-node td{padding:1px 8px 1px 0;vertical-align:top}
.rl-node td:first-child{color:#666;white-space:nowrap}
.rl-node code{font-size:12px;word-break:break-all}
.rl-edge{margin:0 0 0 24px;height:30px;border-left:3px solid #888;position:relative;color:#666;padding-left:8px;
  line-height:30px;font-size:12px}
.rl-edge:after{content:"";position:absolute;left:-8px;bottom:-2px;border:6.5px solid transparent;
  border-top:9px solid #888}
.rl-base{border-style:dashed}
.rl-status{font-weight:700}.ok .rl-status{color:#2ca02c}.bad .rl-status{color:#d62728}
</style>"""


def _row(name: str, value: str) -> str:
    return f"<tr><td>{html.escape(name)}</td><td>{value}</td></tr>"


def _node_html(e: LineageEntry, v: Verification) -> str:
    m = e.manifest
    cls = {True: " ok", False: " bad"}.get(v.ok, "")
    rows = [
        _row("location", f"<code>{html.escape(e.location)}</code>"),
        _row("files", f'<span class="rl-status">{html.escape(v.status)}</span>: {html.escape(v.detail)}'),
        _row("config", f"<code>{html.escape(_short(m.config_hash, 16))}</code>"),
        _row("code", html.escape(_code(m))),
        _row("created", html.escape(m.created_at)),
    ]
    rows += [
        _row(
            f"data {d.name}",
            f"<code>{html.escape(d.path)}</code> sha256 <code>{html.escape(_short(d.sha256, 16))}</code>",
        )
        for d in m.data
    ]
    rows += [
        _row("served", f"iterations {html.escape(s.iterations)} by <code>{html.escape(s.engine)}</code>: "
             f"{html.escape(_versions(s.weight_versions))}")
        for s in m.served
    ]  # fmt: skip
    metrics = ", ".join(f"{k} {m.metrics[k]:.4g}" for k in KEY_METRICS if k in m.metrics)
    if metrics:
        rows.append(_row("metrics", html.escape(metrics)))
    return (
        f'<section class="rl-node{cls}" data-step="{m.step}"><h4>{html.escape(_title(m))} · '
        f"{html.escape(m.experiment)}</h4><table>{''.join(rows)}</table></section>"
    )


def lineage_html(chain: LineageChain, checks: list[Verification]) -> str:
    """The chain as an HTML fragment: a box per checkpoint, arrows to its parent, the base model at the bottom."""
    parts = []
    for e, v in zip(chain.entries, checks, strict=True):
        parts.append(_node_html(e, v))
        label = "parent (weights only)" if e.manifest.parent_weights_only else "parent"
        parts.append(f'<div class="rl-edge">{label}</div>')
    if chain.note:
        parts.append(f'<section class="rl-node bad"><h4>chain ends early</h4>{html.escape(chain.note)}</section>')
    base = chain.entries[-1].manifest.base_model
    arch = ", ".join(f"{k} {v}" for k, v in (base.architecture or {}).items() if v is not None)
    rows = _row("path", f"<code>{html.escape(base.path)}</code>") + _row(
        "fingerprint", f"<code>{html.escape(_short(base.fingerprint, 16))}</code>"
    )
    rows += _row("architecture", html.escape(arch)) if arch else ""
    parts.append(f'<section class="rl-node rl-base"><h4>base model</h4><table>{rows}</table></section>')
    failed = sum(v.ok is False for v in checks)
    summary = f"{len(chain.entries)} checkpoints" + (f", {failed} FAILED verification" if failed else "")
    return f'{STYLE}<div class="rl-lineage"><p>{html.escape(summary)}</p>{"".join(parts)}</div>'


def lineage_page(chain: LineageChain, checks: list[Verification]) -> str:
    """A standalone HTML page (offline: no script, no external resource)."""
    title = html.escape(f"lineage of {chain.entries[0].location}")
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
        f"<body><h2>{title}</h2>{lineage_html(chain, checks)}</body></html>\n"
    )


def lineage_fragment(location: str, verify_max_bytes: float | None = DECK_VERIFY_BYTES) -> str:
    """The Lineage deck's HTML for a checkpoint path or URI."""
    chain = lineage_chain(location)
    return lineage_html(chain, verify_chain(chain, verify_max_bytes))


def render_lineage(location: str, fmt: str, verify_max_bytes: float | None = None) -> str:
    """`rlpipe lineage --format FMT` output (text, html, mermaid, dot); every file is re-hashed unless limited."""
    renderers = {"text": lineage_text, "html": lineage_page, "mermaid": lineage_mermaid, "dot": lineage_dot}
    if fmt not in renderers:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    chain = lineage_chain(location)
    return renderers[fmt](chain, verify_chain(chain, verify_max_bytes))
