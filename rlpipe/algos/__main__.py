"""``python -m rlpipe.algos``: a worked example with small numbers, to see what the formulas do."""

from __future__ import annotations

import torch

from rlpipe.algos.advantages import compute_advantages
from rlpipe.algos.kl import kl_penalty
from rlpipe.algos.policy_loss import ppo_clip
from rlpipe.algos.rollout_is import rollout_is_weights


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:+.3f}" for v in t.reshape(-1).tolist()) + "]"


def main() -> None:
    """Print GRPO/RLOO/Dr.GRPO advantages of one group, a clipped PPO loss per ratio, KL kinds, an IS weight."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    print("1) One prompt, 8 sampled responses, rewards", _fmt(rewards))
    for name in ("grpo", "rloo", "dr_grpo"):
        print(f"   {name:8s} advantages", _fmt(compute_advantages(name, rewards)))
    print("   pass_at_k(k=4)     ", _fmt(compute_advantages("pass_at_k", rewards, k=4)))
    print("   (correct answers are pushed up, wrong ones down; all-equal rewards would give 0)\n")

    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5, 5.0])
    logp = torch.log(ratios)
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp, dtype=torch.bool)
    print("2) PPO clip (eps_low=0.2, eps_high=0.28, dual clip c=3), ratio = exp(logp - old):", _fmt(ratios))
    for adv in (1.0, -1.0):
        a = torch.full_like(logp, adv)
        loss, m = ppo_clip(logp, old, a, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
        print(f"   A={adv:+.0f}: per-token loss", _fmt(loss), f"clip_frac_low={m['clip_frac_low']:.2f}",
              f"clip_frac_high={m['clip_frac_high']:.2f}", f"dual_clip_frac={m['dual_clip_frac']:.2f}")  # fmt: skip
    print("   (A>0: the gain stops above 1.28; A<0: the penalty stops below 0.8 and is capped at 3|A|)\n")

    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    print("3) KL estimators per token, logp =", _fmt(lp), "ref =", _fmt(ref))
    for kind in ("k1", "abs", "k2", "k3"):
        print(f"   {kind:3s}", _fmt(kl_penalty(lp, ref, kind)))
    print()

    old_lp = torch.tensor([-1.0, -1.0, -3.0])
    roll_lp = torch.tensor([-1.0, -1.5, -1.0])
    w, m = rollout_is_weights(
        old_lp, roll_lp, torch.ones(3, dtype=torch.bool), level="token", mode="truncate", upper=2.0
    )
    print("4) Rollout IS, token level, truncate at 2: old", _fmt(old_lp), "rollout", _fmt(roll_lp))
    print("   weights exp(old - rollout) capped:", _fmt(w), f"(raw max {m['rollout_is_max']:.3f})")


if __name__ == "__main__":
    main()
