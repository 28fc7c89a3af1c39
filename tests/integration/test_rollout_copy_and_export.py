"""The weights outside the trainer: the HF rollout copy each worker samples from, and the `checkpoint.save_hf`
export. Both must equal the policy (2 ranks, FSDP2), after RL and SFT steps and after a resume."""

from __future__ import annotations

import pytest
import ray
import torch

from rlpipe.base_model import prepare_base_model
from rlpipe.config import load_config
from rlpipe.data.packing import SequenceItem, pack_sequences
from rlpipe.rollout.engine import SamplingParams
from rlpipe.session import RLSession

from ..conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_session")


def _synced_copy(session: RLSession) -> str:
    """Sample once (this syncs a stale copy), then check every rank's copy equals its policy; the copy's digest."""

    # Defined here so cloudpickle ships it by value: the workers cannot import the `tests` package.
    def _rollout_copy_state(worker) -> tuple[float, str]:
        """(max |rollout copy - policy| over every weight, digest of the copy), run inside a worker."""
        import hashlib

        from rlpipe.train.policy import full_hf_state_dict

        policy = full_hf_state_dict(worker.policy)
        copy = dict(worker.rollout_model.named_parameters())
        assert set(copy) <= set(policy), set(copy) - set(policy)
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for _, p in sorted(copy.items())))
        return max(float((p - policy[n].to(p)).abs().max()) for n, p in copy.items()), digest.hexdigest()

    session.controller.generate([[1, 5, 6]] * session.controller.world_size, SamplingParams(n=2, max_new_tokens=2))
    states = ray.get([w.__ray_call__.remote(_rollout_copy_state) for w in session.controller.workers])
    for diff, _ in states:
        assert diff == 0.0
    assert len({d for _, d in states}) == 1
    return states[0][1]


def _items(n: int = 4) -> list[SequenceItem]:
    gen = torch.Generator().manual_seed(0)
    return [
        SequenceItem(
            prompt_ids=torch.randint(3, 20, (5,), generator=gen).tolist(),
            response_ids=torch.randint(3, 20, (4,), generator=gen).tolist(),
            row=i,
        )  # fmt: skip
        for i in range(n)
    ]


def hf_logprobs(model, item: SequenceItem) -> torch.Tensor:
    """Logprob of every response token under a plain HF forward (no packing)."""
    ids = torch.tensor([item.prompt_ids + item.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
    p = len(item.prompt_ids)
    return logp[p - 1 : -1].gather(-1, ids[0, p:, None]).squeeze(-1)


def trainer_logprobs(session: RLSession, items: list[SequenceItem], reference: bool = False) -> list[torch.Tensor]:
    """The same, from the training workers (old-policy or reference logprobs of packs)."""
    packs = pack_sequences(items, 64, 0, dp_size=session.controller.dp_size, pad_to_max_length=False)
    values = session.controller.compute_logprobs(packs, reference=reference)
    out = []
    for item in items:
        (row,) = [v[(p.seq_index == item.row) & (p.shifted_labels != -100)] for p, v in zip(packs, values, strict=True)
                  if ((p.seq_index == item.row) & (p.shifted_labels != -100)).any()]  # fmt: skip
        out.append(row)
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_rollout_copy_and_hf_export_equal_the_policy(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"train.world_size": 2, "train.fsdp": True, "iterations": 2, "sft.enabled": True,
             "sft.global_batch_size": 4, "checkpoint.save_hf": True, "model.tiny.tie_word_embeddings": tied}  # fmt: skip
    cfg = load_config(overrides=tiny_overrides(tmp_path, **extra))
    model_dir = prepare_base_model(cfg)
    session = RLSession(cfg, model_dir)
    try:
        base = _synced_copy(session)
        batch, _ = session.rollout()
        batch["advantage"] = [(-1.0) ** i for i in range(len(batch))]  # a real update even if every reward tied
        session.train(batch)
        after_rl = _synced_copy(session)
        session.sft()
        after_sft = _synced_copy(session)
        assert len({base, after_rl, after_sft}) == 3  # every step moved the weights and the copy followed
        ckpt = session.save("train")
    finally:
        session.close()
    hf_dir = f"{ckpt}/hf"
    export = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert export.config.tie_word_embeddings is tied
    assert (export.lm_head.weight.data_ptr() == export.model.embed_tokens.weight.data_ptr()) is tied
    tok = AutoTokenizer.from_pretrained(hf_dir)  # servable: the tokenizer is exported with the weights
    assert tok.decode(tok("1+2=")["input_ids"], skip_special_tokens=True) == "1+2="
    resumed = RLSession(cfg, model_dir, ckpt)
    try:
        assert _synced_copy(resumed) == after_sft
        items = _items()
        for item, lp in zip(items, trainer_logprobs(resumed, items), strict=True):
            torch.testing.assert_close(lp, hf_logprobs(export, item), rtol=0, atol=1e-5)
    finally:
        resumed.close()
