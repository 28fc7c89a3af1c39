"""EpochSampler: determinism, epoch semantics, dp sharding, JSON resume and state validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlpipe.data.sampler import EpochSampler
from rlpipe.errors import ConfigError, DataError


def naive_stream(n: int, b: int, seed: int, steps: int, drop_last: bool, shuffle: bool = True) -> list[list[int]]:
    """Reference: materialise epochs as numpy permutations and cut batches out of them."""
    out: list[list[int]] = []
    epoch = 0
    buf: list[int] = []
    while len(out) < steps:
        perm = list(np.random.default_rng([seed, epoch]).permutation(n)) if shuffle else list(range(n))
        epoch += 1
        if drop_last:
            for k in range(n // b):
                out.append([int(i) for i in perm[k * b : (k + 1) * b]])
        else:
            buf.extend(int(i) for i in perm)
            while len(buf) >= b:
                out.append(buf[:b])
                buf = buf[b:]
    return out[:steps]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "b"), [(10, 3), (12, 4), (7, 7), (5, 2)])
def test_matches_naive_stream(n: int, b: int, drop_last: bool) -> None:
    s = EpochSampler(n, b, seed=3, drop_last=drop_last)
    got = [s.next_batch() for _ in range(9)]
    assert got == naive_stream(n, b, 3, 9, drop_last)
    assert s.state_dict()["total_consumed"] == 9 * b


def test_deterministic_and_seed_dependent() -> None:
    a = [EpochSampler(50, 8, seed=1).next_batch() for _ in range(1)]
    b = [EpochSampler(50, 8, seed=1).next_batch() for _ in range(1)]
    c = [EpochSampler(50, 8, seed=2).next_batch() for _ in range(1)]
    assert a == b and a != c
    # [seed, epoch] seeding: seed 0 epoch 1 differs from seed 1 epoch 0
    assert EpochSampler(50, 8, seed=0).epoch_permutation(1) != EpochSampler(50, 8, seed=1).epoch_permutation(0)
    assert EpochSampler(6, 2, seed=0, shuffle=False).next_batch() == [0, 1]


def test_epoch_coverage() -> None:
    s = EpochSampler(10, 5, seed=0)
    first, second = s.next_batch(), s.next_batch()
    assert sorted(first + second) == list(range(10))
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["consumed_in_epoch"] == 0
    # drop_last=False: batch crosses the boundary, each epoch still covers everything once
    t = EpochSampler(10, 4, seed=0, drop_last=False)
    flat = [i for _ in range(5) for i in t.next_batch()]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_continues_exactly(drop_last: bool) -> None:
    ref = EpochSampler(11, 4, seed=7, drop_last=drop_last)
    uninterrupted = [ref.next_batch() for _ in range(6)]
    s = EpochSampler(11, 4, seed=7, drop_last=drop_last)
    for _ in range(3):
        s.next_batch()
    saved = json.dumps(s.state_dict())  # must be plain JSON
    resumed = EpochSampler(11, 4, seed=7, drop_last=drop_last)
    resumed.load_state_dict(json.loads(saved))
    assert [resumed.next_batch() for _ in range(3)] == uninterrupted[3:]
    assert resumed.state_dict() == ref.state_dict()


def test_loaded_seed_defines_stream() -> None:
    s = EpochSampler(20, 4, seed=5)
    s.next_batch()
    other = EpochSampler(20, 4, seed=99)
    other.load_state_dict(s.state_dict())
    assert other.next_batch() == s.next_batch()


@pytest.mark.parametrize("drop_last", [True, False])
def test_dp_shards_disjoint_and_cover(drop_last: bool) -> None:
    dp = 4
    ranks = [EpochSampler(23, 8, seed=2, drop_last=drop_last, dp_rank=r, dp_size=dp) for r in range(dp)]
    glob = EpochSampler(23, 8, seed=2, drop_last=drop_last)
    for _ in range(7):
        shares = [r.next_batch() for r in ranks]
        full = glob.next_batch()
        assert all(len(sh) == 2 for sh in shares)
        assert sum(shares, []) == full  # rank r = r-th contiguous slice
        assert len(set(full)) == len(full) or not drop_last
    if drop_last:
        assert len({i for sh in shares for i in sh}) == 8


def test_constructor_errors() -> None:
    with pytest.raises(ConfigError):
        EpochSampler(10, 3, seed=0, dp_size=2)
    with pytest.raises(ConfigError):
        EpochSampler(10, 4, seed=0, dp_rank=2, dp_size=2)
    with pytest.raises(ConfigError):
        EpochSampler(3, 4, seed=0)
    with pytest.raises(ConfigError):
        EpochSampler(0, 1, seed=0)
    with pytest.raises(ConfigError):
        EpochSampler(10, 2, seed=-1)
    EpochSampler(3, 4, seed=0, drop_last=False).next_batch()  # allowed: batch spans epochs


JUNK = [
    ("not_dict", [1, 2], "sampler_state"),
    ("missing", {"epoch": 0, "consumed_in_epoch": 0, "seed": 0}, "total_consumed"),
    ("unknown", {"epoch": 0, "consumed_in_epoch": 0, "total_consumed": 0, "seed": 0, "x": 1}, "x"),
    ("str", {"epoch": "0", "consumed_in_epoch": 0, "total_consumed": 0, "seed": 0}, "epoch"),
    ("bool", {"epoch": 0, "consumed_in_epoch": True, "total_consumed": 0, "seed": 0}, "consumed_in_epoch"),
    ("negative", {"epoch": 0, "consumed_in_epoch": 0, "total_consumed": -1, "seed": 0}, "total_consumed"),
    ("float", {"epoch": 0, "consumed_in_epoch": 0, "total_consumed": 0, "seed": 1.5}, "seed"),
    ("range", {"epoch": 0, "consumed_in_epoch": 10, "total_consumed": 0, "seed": 0}, "consumed_in_epoch"),
    (
        "other_dataset",
        {"epoch": 0, "consumed_in_epoch": 0, "total_consumed": 0, "seed": 0, "num_examples": 9},
        "num_examples",
    ),
]


@pytest.mark.parametrize(("case", "state", "field"), JUNK, ids=[j[0] for j in JUNK])
def test_load_state_rejects_junk(case: str, state, field: str) -> None:
    s = EpochSampler(10, 2, seed=0)
    before = s.state_dict()
    with pytest.raises(DataError) as err:
        s.load_state_dict(state)
    assert err.value.field == field
    assert s.state_dict() == before  # a rejected state leaves the sampler untouched
