"""Training side of rlpipe: the Ray training worker and controller, optimizer/LR schedule, checkpoints and lineage.

Kept import-light on purpose (no torch import here): ``rlpipe.train.lineage`` must load fast for the CLI.
"""
