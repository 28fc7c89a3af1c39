"""``python -m rlpipe.algos`` prints the worked example with the expected numbers."""

from __future__ import annotations

import runpy


def test_worked_example(capsys):
    runpy.run_module("rlpipe.algos", run_name="__main__")
    out = capsys.readouterr().out
    assert "grpo     advantages [+1.208, -0.725" in out  # 3 of 8 correct: (1 - 3/8) / stdev
    assert "A=-1: per-token loss [+0.800" in out and "+3.000]" in out  # clip low and the dual clip
    assert "k3  [+0.107, +0.718]" in out
    assert "[+1.000, +1.649, +0.135]" in out
