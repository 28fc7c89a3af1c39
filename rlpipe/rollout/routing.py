"""Which engine replica samples which prompt: a pure, deterministic assignment by pending work.

All `n` samples of a prompt go to one replica (one request: the prompt's prefix is computed and cached once). The
prompts are visited in a seeded order and each goes to the replica with the least work pending so far (its prompt
plus `n` responses of `max_new_tokens`, in tokens); ties go to the lower replica index. The assignment depends only
on the prompts, the replica count and the salt (rlpipe passes the iteration's sampling seed), so a resumed run sends
every prompt where the unbroken run did, and one replica gets everything, as before replicas existed.
"""

from __future__ import annotations

import random


def assign_prompts(
    prompt_lengths: list[int], replicas: list[int], n: int, max_new_tokens: int, salt: int
) -> dict[int, list[int]]:
    """{replica: [prompt index, ...] in ascending order} over the given live `replicas` (their ids)."""
    if not replicas:
        raise ValueError("assign_prompts: no replica to assign prompts to")
    order = list(range(len(prompt_lengths)))
    random.Random(salt).shuffle(order)
    pending = {r: 0 for r in replicas}
    assigned: dict[int, list[int]] = {r: [] for r in replicas}
    for i in order:
        target = min(replicas, key=lambda r: (pending[r], r))
        pending[target] += prompt_lengths[i] + n * max_new_tokens
        assigned[target].append(i)
    return {r: sorted(ids) for r, ids in assigned.items()}
