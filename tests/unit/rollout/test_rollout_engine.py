"""The rollout contract types: SamplingParams validation and stop-token truncation."""

from __future__ import annotations

import pytest

from rlpipe.errors import ConfigError
from rlpipe.rollout.engine import SamplingParams, truncate_at_stop


def test_sampling_params_defaults_and_validation():
    p = SamplingParams(n=2)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop_token_ids, p.seed) == (1.0, 1.0, 0, 32, [], 0)
    assert not p.greedy and SamplingParams(n=1, temperature=0).greedy
    assert SamplingParams(n=1).stop_token_ids is not SamplingParams(n=1).stop_token_ids
    for bad in [
        dict(n=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_new_tokens=0),
    ]:
        with pytest.raises(ConfigError):
            SamplingParams(**{"n": 1, **bad})


def test_truncate_at_stop():
    assert truncate_at_stop([5, 2, 7, 2], [-1, -2, -3, -4], {2}) == ([5, 2], [-1, -2], "stop")
    assert truncate_at_stop([5, 6], [-1, -2], {2}) == ([5, 6], [-1, -2], "length")
    assert truncate_at_stop([9, 5], [-1, -2], {2, 9}) == ([9], [-1], "stop")
    assert truncate_at_stop([], [], {2}, eos_token_id=2) == ([2], [0.0], "stop")  # never empty
    assert truncate_at_stop([], [], {2}) == ([], [], "length")
