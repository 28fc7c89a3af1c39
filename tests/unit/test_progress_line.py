"""The progress line the segment task prints: iteration out of total and the headline metrics, robust to gaps."""

from __future__ import annotations

from rlpipe.loop import progress_line


def test_progress_line_shows_iteration_and_reward():
    row = {"iteration": 20.0, "reward_mean": 0.4567, "pass_at_n": 0.9, "loss": 0.01234, "rollout_entropy": 0.5}
    line = progress_line(row, 400)
    assert line == "iteration 20/400 reward 0.457 pass@n 0.900 loss 0.0123 entropy 0.500"


def test_progress_line_tolerates_missing_metrics():
    assert progress_line({"iteration": 3.0}, 10) == "iteration 3/10 reward n/a pass@n n/a loss n/a entropy n/a"
