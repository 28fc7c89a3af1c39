"""Shared bits of the benchmarks: machine description, medians, and appending a section to bench/RESULTS.md.

Why one helper: every script must record the same provenance (exact command, cores, torch threads, date) so numbers
in RESULTS.md can be compared and reproduced.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# rlpipe benchmark results\n\n"
    "Appended by the scripts in `bench/` (see bench/README.md). Every section records the exact command, the\n"
    "machine and the date; numbers are medians over repeats, and every ratio is measured side by side in the same\n"
    "run (A/B alternated), so a busy shared machine slows both sides alike.\n"
)


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that produced this run (run from the repo root), as it could be pasted into a shell."""
    args = sys.argv[1:] if argv is None else argv
    rel = os.path.relpath(script, Path(__file__).resolve().parent.parent)
    return "python " + " ".join(shlex.quote(a) for a in [rel, *args])


def machine_line() -> str:
    """Cores, torch intra-op threads, torch version and platform."""
    import torch

    return (
        f"nproc={os.cpu_count()}, torch.get_num_threads()={torch.get_num_threads()}, torch {torch.__version__}, "
        f"{platform.machine()} {platform.system()}, python {platform.python_version()}"
    )


def repo_relative(path: Path) -> str:
    """`path` as the README and RESULTS.md name files: relative to the repo when it is inside it."""
    repo = Path(__file__).resolve().parent.parent
    path = Path(path).resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table; floats get 4 significant digits."""

    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(title: str, body: str, results: Path | None, script: str, argv: list[str] | None) -> str:
    """Append ``## title`` with provenance and ``body`` to RESULTS.md (created with a header if missing)."""
    path = results or RESULTS
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = f"\n## {title}\n\n- command: `{command_line(script, argv)}`\n- machine: {machine_line()}\n- date: {now}\n\n{body.strip()}\n"
    if not path.exists():
        path.write_text(HEADER)
    with path.open("a") as fh:
        fh.write(section)
    return section


def finish_reward_plot(fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Shared look of the reward plots (0..1 axis, legend bottom right) and save them as PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mcnemar_exact(before: list[float], after: list[float]) -> dict[str, float]:
    """Exact McNemar test of paired 0/1 outcomes (the same held-out problems scored before and after training).

    Only the discordant pairs carry evidence: ``gained`` (wrong before, right after) and ``lost`` (right before,
    wrong after). Under "training changed nothing" each discordant pair is a fair coin, so ``gained`` is
    Binomial(gained + lost, 1/2) (McNemar 1947; the exact form, not the chi-square approximation, because the
    counts are small). ``p_improved`` is the one-sided P(X >= gained), the chance of at least this many gains by
    luck; ``p_two_sided`` doubles the smaller tail (capped at 1). An outcome counts as right when its reward > 0.5.
    """
    if len(before) != len(after):
        raise ValueError(f"paired outcomes need equal lengths, got {len(before)} and {len(after)}")
    gained = sum(1 for b, a in zip(before, after, strict=True) if b <= 0.5 < a)
    lost = sum(1 for b, a in zip(before, after, strict=True) if a <= 0.5 < b)
    n = gained + lost

    def tail(k: int) -> float:  # P(X >= k), X ~ Binomial(n, 1/2)
        return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n

    upper, lower = tail(gained), 1.0 - tail(gained + 1)  # P(X >= gained), P(X <= gained)
    return {"gained": gained, "lost": lost, "p_improved": upper, "p_two_sided": min(1.0, 2 * min(upper, lower))}


def verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


VOCAB = 105  # the tiny character tokenizer's vocabulary (rlpipe.models.tokenizer.build_tiny_tokenizer)


def length_mix(n: int, seed: int, max_response: int = 200) -> list:
    """Prompts uniform in [10, 40]; responses lognormal (median ~20, long tail) clipped to [1, max_response]."""
    import torch

    from rlpipe.data.packing import SequenceItem

    gen = torch.Generator().manual_seed(seed)
    items = []
    for row in range(n):
        p = int(torch.randint(10, 41, (1,), generator=gen))
        r = int(torch.empty(1).log_normal_(3.0, 1.0, generator=gen).clamp(1, max_response).round())
        ids = torch.randint(3, VOCAB, (p + r,), generator=gen).tolist()
        items.append(
            SequenceItem(
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                advantage=float(torch.randn(1, generator=gen)),
                rollout_logprobs=(-torch.rand(r, generator=gen) * 3).tolist(),
                row=row,
            )
        )
    return items
