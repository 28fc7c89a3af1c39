"""Pure tensor functions of the GRPO family: advantages, policy losses, KL estimators, rollout IS, chunked logprobs.

No model, no I/O, no ``torch.distributed``: every function maps tensors to tensors, and metrics come back as
reducible ``MetricSums`` so the training worker decides how to all-reduce them. ``python -m rlpipe.algos`` prints a
worked example.
"""

from rlpipe.algos.advantages import ADVANTAGES, compute_advantages
from rlpipe.algos.entropy import entropy_metric, sampled_token_entropy_sum
from rlpipe.algos.kl import KL_KINDS, kl_penalty, masked_kl_sum
from rlpipe.algos.logprobs import chunked_cross_entropy, chunked_logprobs, eager_logprobs
from rlpipe.algos.metrics import MetricSums
from rlpipe.algos.policy_loss import AGG_MODES, POLICY_LOSSES, aggregate
from rlpipe.algos.registry import UnknownNameError
from rlpipe.algos.rollout_is import mismatch_metrics, rollout_is_weights

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "MetricSums",
    "UnknownNameError",
    "aggregate",
    "chunked_cross_entropy",
    "chunked_logprobs",
    "compute_advantages",
    "eager_logprobs",
    "entropy_metric",
    "kl_penalty",
    "masked_kl_sum",
    "mismatch_metrics",
    "rollout_is_weights",
    "sampled_token_entropy_sum",
]
