"""Flyte workflows of rlpipe: `grpo` (segments, the fast default) and `grpo_granular` (one task per phase)."""
