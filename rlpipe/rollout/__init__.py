"""Rollout: the ``RolloutEngine`` protocol, the HF generate engine, the OpenAI-compatible server engine, judges.

Import the submodules directly (``from rlpipe.rollout.engine import SamplingParams``).
"""
