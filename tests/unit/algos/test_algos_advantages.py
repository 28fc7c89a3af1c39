"""Advantage estimators against naive per-group python loops, and pass@k against subset enumeration."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from rlpipe.algos.advantages import ADVANTAGES, compute_advantages, dr_grpo, grpo, opo, pass_at_k, rloo
from rlpipe.errors import RlpipeError


@pytest.fixture
def rewards():
    torch.manual_seed(0)
    return torch.randn(5, 6, dtype=torch.float64)


def _naive_grpo(group, eps=1e-8):
    if len(group) < 2:
        return [0.0] * len(group)
    mu, sd = statistics.mean(group), statistics.stdev(group)
    return [(r - mu) / (sd + eps) for r in group]


def _naive_rloo(group):
    g = len(group)
    if g < 2:
        return [0.0] * g
    return [r - sum(group[j] for j in range(g) if j != i) / (g - 1) for i, r in enumerate(group)]


def _naive_opo(group, lengths):
    b = sum(n * r for n, r in zip(lengths, group, strict=True)) / sum(lengths)
    return [r - b for r in group]


def _rows(fn, *tensors):
    return torch.tensor(
        [fn(*(t[i].tolist() for t in tensors)) for i in range(tensors[0].shape[0])], dtype=torch.float64
    )


def test_grpo_rloo_drgrpo_opo_match_loops(rewards):
    lengths = torch.randint(1, 20, rewards.shape).double()
    torch.testing.assert_close(grpo(rewards), _rows(_naive_grpo, rewards))
    torch.testing.assert_close(rloo(rewards), _rows(_naive_rloo, rewards))
    torch.testing.assert_close(
        dr_grpo(rewards, lengths, 32), _rows(lambda g: [r - statistics.mean(g) for r in g], rewards)
    )
    torch.testing.assert_close(opo(rewards, lengths), _rows(_naive_opo, rewards, lengths))


def test_opo_with_equal_lengths_is_mean_baseline(rewards):
    torch.testing.assert_close(opo(rewards, torch.full_like(rewards, 7.0)), dr_grpo(rewards))
    # a group whose lengths sum to 0 falls back to the plain mean instead of dividing by zero
    out = opo(rewards, torch.zeros_like(rewards))
    torch.testing.assert_close(out, dr_grpo(rewards))


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo", "opo"])
def test_all_equal_rewards_give_zero(name):
    r = torch.full((3, 4), 0.7)
    out = compute_advantages(name, r, lengths=torch.ones(3, 4))
    assert torch.equal(out, torch.zeros_like(r))


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo", "opo", "pass_at_k"])
def test_single_sample_groups_give_zero_not_nan(name):
    r = torch.tensor([[1.0], [0.0], [1.0]])
    kw = {"k": 1} if name == "pass_at_k" else {}
    out = compute_advantages(name, r, lengths=torch.tensor([[3.0], [2.0], [5.0]]), **kw)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(r))


def test_shape_dtype_and_integer_rewards():
    r = torch.tensor([[1, 0, 1, 1]])
    out = grpo(r)
    assert out.dtype == torch.float32 and out.shape == (1, 4)
    assert grpo(torch.zeros(2, 3, dtype=torch.float64)).dtype == torch.float64
    with pytest.raises(ValueError, match="num_groups, group_size"):
        grpo(torch.zeros(4))


def _brute_pass_at_k(group, k):
    """Average, over the k-subsets containing each response, of the subset's normalised max reward."""
    n = len(group)
    subsets = list(itertools.combinations(range(n), k))
    g = [max(group[i] for i in s) for s in subsets]
    mean = sum(g) / len(g)
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / len(g))
    adv = []
    for i in range(n):
        mine = [(gs - mean) / (std + 1e-8) for s, gs in zip(subsets, g, strict=True) if i in s]
        adv.append(sum(mine) / len(mine))
    return adv


@pytest.mark.parametrize("n,k", [(4, 1), (4, 2), (6, 3), (8, 4), (5, 5)])
def test_pass_at_k_matches_subset_enumeration(n, k):
    groups = [[float(i < pos) for i in range(n)] for pos in range(n + 1)]  # every number of correct answers
    torch.manual_seed(n * 10 + k)
    groups = [[g[j] for j in torch.randperm(n).tolist()] for g in groups]
    r = torch.tensor(groups, dtype=torch.float64)
    expected = torch.tensor([_brute_pass_at_k(g, k) for g in groups], dtype=torch.float64)
    torch.testing.assert_close(pass_at_k(r, k), expected, atol=1e-6, rtol=1e-6)
    # all-correct and all-wrong groups carry no signal
    assert torch.equal(pass_at_k(r, k)[[0, n]], torch.zeros(2, n, dtype=torch.float64))


def test_pass_at_1_is_grpo_with_population_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]])
    pop = (r - r.mean()) / (r.std(correction=0) + 1e-8)
    torch.testing.assert_close(pass_at_k(r, 1), pop)


def test_pass_at_k_rejects_bad_input():
    with pytest.raises(ValueError, match="k <= group_size"):
        pass_at_k(torch.ones(1, 3), 4)
    with pytest.raises(ValueError, match="binary"):
        pass_at_k(torch.tensor([[0.5, 1.0]]), 1)


def test_dispatcher():
    assert set(ADVANTAGES) == {"grpo", "rloo", "dr_grpo", "opo", "pass_at_k"}
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    lengths = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # lengths are only passed to estimators that take them
    torch.testing.assert_close(compute_advantages("grpo", r, lengths=lengths), grpo(r))
    torch.testing.assert_close(compute_advantages("opo", r, lengths=lengths), opo(r, lengths))
    torch.testing.assert_close(compute_advantages("pass_at_k", r, lengths=lengths, k=2), pass_at_k(r, 2))
    with pytest.raises(ValueError, match="opo needs lengths"):
        compute_advantages("opo", r)
    with pytest.raises(ValueError, match="grpo, opo, pass_at_k, rloo") as err:
        compute_advantages("grpoo", r)
    assert isinstance(err.value, RlpipeError)


# -- issue 17: uniform groups are exact, whatever the precision of the rewards ---------------------------------------
def _naive_pass_at_k_binary(group, k):
    """Pass@k advantage straight from the paper's closed form (Chen et al. 2025), in python floats."""
    n, n_neg = len(group), sum(1 for r in group if r == 0)
    mean = 1 - math.comb(n_neg, k) / math.comb(n, k)
    std = math.sqrt(mean * (1 - mean))
    neg = 1 - mean - (math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1) if n_neg > 0 else 0.0)
    return [((1 - mean) if r == 1 else neg) / (std + 1e-8) for r in group]


NAIVE = {  # per-group python formulas of the papers (statistics.mean / stdev are exact on python floats)
    "grpo": lambda g, lens: _naive_grpo(g),
    "rloo": lambda g, lens: _naive_rloo(g),
    "dr_grpo": lambda g, lens: [r - statistics.mean(g) for r in g],
    "opo": lambda g, lens: _naive_opo(g, lens),
    "pass_at_k": lambda g, lens: _naive_pass_at_k_binary(g, 2),
}


def test_naive_table_covers_every_registered_estimator():
    assert set(NAIVE) == set(ADVANTAGES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_uniform_groups_give_exact_zero(name, dtype):
    """Groups of 0.1, 0.7, 1/3 (not exact in binary) of sizes 3..16: every advantage is exactly 0 (float32 GRPO gave
    |A| ~ 0.4-0.8 for 8 or 16 equal rewards: mean and std both ~6e-8, which eps=1e-8 does not dominate)."""
    values = [0.0, 1.0] if name == "pass_at_k" else [0.1, 0.7, 1 / 3, 0.9, 2.3]
    for g in (3, 5, 8, 16):
        r = torch.tensor([[v] * g for v in values], dtype=dtype)
        lengths = torch.arange(1, g + 1, dtype=dtype).repeat(len(values), 1)
        out = compute_advantages(name, r, lengths=lengths, **({"k": 2} if name == "pass_at_k" else {}))
        assert out.dtype == dtype
        assert torch.equal(out, torch.zeros_like(r)), (name, g, out.abs().max().item())


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_mixed_and_uniform_float32_groups_match_naive_formulas(name):
    """float32 rewards (as the RolloutBatch stores them), mixed with uniform groups: each row equals the paper's
    formula evaluated in python floats on the same float32 values."""
    if name == "pass_at_k":
        rows = [[1, 0, 0, 1, 0, 0, 0, 0], [1] * 8, [0] * 8, [0, 1, 1, 1, 1, 1, 1, 0]]
    else:
        rows = [
            [0.1, 0.7, 0.1, 0.1, 1 / 3, 0.7, 0.1, 0.9],
            [0.7] * 8,
            [0.1] * 8,
            [1 / 3] * 8,
            [0.25, 0.5, 0.75, 0.2, 0.3, 0.31, 0.32, 0.33],
        ]
    r = torch.tensor(rows, dtype=torch.float32)
    lengths = torch.tensor([[1.0 + (3 * i + j) % 7 for j in range(8)] for i in range(len(rows))])
    out = compute_advantages(name, r, lengths=lengths, **({"k": 2} if name == "pass_at_k" else {}))
    expected = torch.tensor(
        [NAIVE[name](r[i].double().tolist(), lengths[i].double().tolist()) for i in range(len(rows))],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    uniform = [i for i, row in enumerate(rows) if len(set(row)) == 1]
    assert torch.equal(out[uniform], torch.zeros(len(uniform), 8))
