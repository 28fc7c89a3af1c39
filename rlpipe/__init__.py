"""rlpipe: RL post-training for causal LMs."""

__version__ = "0.1.0"
