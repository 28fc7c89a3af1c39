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
