"""Packed vs padded RL training throughput (real tokens per second) on a long-tailed length mix.

One timed unit is a full optimizer step over a global batch: forward + backward of ``rl_microbatch_loss`` for
every micro-batch, then AdamW. Both layouts use the same token budget per micro-batch (``--budget``):

- packed: ``pack_sequences(..., pad_to_max_length=False)`` -> 1-D rows through ``PolicyModel`` with the trainer's
  per-sequence attention (``rlpipe.models.packed_attention``; no cross-sequence attention, no L x L mask);
- padded: sequences in arrival order, greedily grouped so ``count * longest <= budget``, each group
  ``pad_sequences``-ed to its longest and run as a ``[B, Lmax]`` batch with a padding attention mask (standard HF
  padded training); the loss sees the flattened batch.

tokens/s counts only real (prompt + response) tokens for both layouts. Repeats alternate A/B; the ratio is the
median of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import VOCAB, length_mix, median, table, verdict, write_section  # noqa: E402

from rlpipe.algos.logprobs import chunked_logprobs  # noqa: E402
from rlpipe.config import AlgoConfig  # noqa: E402
from rlpipe.data.packing import Pack, SequenceItem, efficient_attn_ratio, pack_sequences, pad_sequences  # noqa: E402
from rlpipe.models.packed import lm_head_weight  # noqa: E402
from rlpipe.models.packed_attention import scoring_attention  # noqa: E402
from rlpipe.models.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from rlpipe.train.objective import StepSums, rl_microbatch_loss  # noqa: E402
from rlpipe.train.policy import PolicyModel  # noqa: E402

PAD = 0
TARGET = 1.5
MODELS = {
    "tiny": TinyModelConfig(),
    "8m": TinyModelConfig(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=1024),
}


def padded_groups(items: list[SequenceItem], budget: int) -> list[list[SequenceItem]]:
    """Arrival-order micro-batches whose padded size ``count * longest`` stays within ``budget``."""
    groups: list[list[SequenceItem]] = [[]]
    longest = 0
    for it in items:
        new_longest = max(longest, it.length)
        if groups[-1] and (len(groups[-1]) + 1) * new_longest > budget:
            groups.append([])
            new_longest = it.length
        groups[-1].append(it)
        longest = new_longest
    return groups


def _concat(packs: list[Pack]) -> Pack:
    """Flatten a padded batch into one Pack-shaped record (only the fields the loss reads need to be right)."""
    cat = {name: torch.cat([getattr(p, name) for p in packs]) for name in ("input_ids", "position_ids",
                                                                            "shifted_labels", "advantages",
                                                                            "rollout_logprobs", "seq_index")}  # fmt: skip
    return Pack(cu_seq_lens=torch.tensor([0, cat["input_ids"].numel()], dtype=torch.int32), **cat)


def padded_logprobs(hf, packs: list[Pack], chunk_size: int) -> torch.Tensor:
    """``[B*Lmax]`` logprobs of a padded batch: batched forward with a 2-D padding mask, chunked LM head."""
    ids = torch.stack([p.input_ids for p in packs])
    mask = torch.stack([p.seq_index >= 0 for p in packs]).long()
    labels = torch.cat([p.shifted_labels for p in packs])
    hidden = hf.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), lm_head_weight(hf), labels, chunk_size)


def train_step(policy: PolicyModel, opt, micro: list, padded: bool, algo: AlgoConfig, label_tokens: int,
               num_seqs: int, max_response: int) -> None:  # fmt: skip
    """Forward/backward of the RL loss over every micro-batch, then one optimizer step."""
    global_tokens = torch.tensor(float(label_tokens))
    global_seqs = torch.tensor(float(num_seqs))
    sums = StepSums("cpu")
    for mb in micro:
        if padded:
            pack = _concat(mb)
            lp = padded_logprobs(policy.hf, mb, algo.chunk_size)
        else:
            pack = mb
            lp = policy.logprobs(pack)
        loss = rl_microbatch_loss(lp, pack, pack.rollout_logprobs, None, None, algo, global_tokens, global_seqs,
                                  max_response, sums)  # fmt: skip
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def profile_top(
    policy,
    opt,
    micro,
    padded: bool,
    algo: AlgoConfig,
    label_tokens: int,
    num_seqs: int,
    max_response: int,
    top: int = 4,
) -> str:
    """Self-CPU share of the top ops of one step (torch.profiler): what bounds a layout when a target is missed."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(policy, opt, micro, padded, algo, label_tokens, num_seqs, max_response)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return ", ".join(f"`{e.key}` {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:top])


def use_layout_attention(hf, padded: bool) -> None:
    """What the trainer runs: per-sequence attention for packs (PACKED_SDPA), stock sdpa + mask for padded rows."""
    hf.set_attn_implementation("sdpa" if padded else scoring_attention("sdpa"))


def bench_model(
    name: str, cfg: TinyModelConfig, items: list[SequenceItem], budget: int, repeats: int, profile: bool = True
) -> dict:
    """Median step time and tokens/s of both layouts on one model; A/B alternated per repeat."""
    hf = build_tiny_model(cfg, VOCAB, seed=0)
    hf.train()
    params = sum(p.numel() for p in hf.parameters())
    algo = AlgoConfig()
    policy = PolicyModel(hf, algo.chunk_size)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    packs = pack_sequences(items, budget, PAD, pad_to_max_length=False)
    groups = [pad_sequences(g, PAD) for g in padded_groups(items, budget)]
    real = sum(it.length for it in items)
    label_tokens = sum(len(it.response_ids) for it in items)
    padded_positions = sum(len(g) * g[0].length for g in groups)
    max_resp = max(len(it.response_ids) for it in items)
    layouts = {"packed": (packs, False), "padded": (groups, True)}
    for micro, is_padded in layouts.values():  # warm-up (allocator, kernels) outside the timing
        use_layout_attention(hf, is_padded)
        train_step(policy, opt, micro[:1], is_padded, algo, label_tokens, len(items), max_resp)
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    for r in range(repeats):
        order = ["packed", "padded"] if r % 2 == 0 else ["padded", "packed"]
        for layout in order:
            micro, is_padded = layouts[layout]
            use_layout_attention(hf, is_padded)
            t0 = time.perf_counter()
            train_step(policy, opt, micro, is_padded, algo, label_tokens, len(items), max_resp)
            times[layout].append(time.perf_counter() - t0)
    ratios = [pd / pk for pk, pd in zip(times["packed"], times["padded"], strict=True)]
    profiles = {}
    if profile and median(ratios) < TARGET:
        for layout, (micro, is_padded) in layouts.items():
            use_layout_attention(hf, is_padded)
            profiles[layout] = profile_top(policy, opt, micro, is_padded, algo, label_tokens, len(items), max_resp)
    return {
        "budget": budget,
        "profiles": profiles,
        "attn_ratio": efficient_attn_ratio(packs),
        "model": name,
        "params": params,
        "real_tokens": real,
        "micro_packed": len(packs),
        "micro_padded": len(groups),
        "pad_fraction": 1 - real / padded_positions,
        "t_packed": median(times["packed"]),
        "t_padded": median(times["padded"]),
        "ratio": median(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed A/B pairs per model (median reported)")
    ap.add_argument("--quick", action="store_true", help="tiny model, small batch, 1 repeat (smoke test)")
    ap.add_argument("--batch", type=int, default=128, help="sequences per optimizer step")
    ap.add_argument("--budgets", default="512,2048", help="comma list of micro-batch token budgets (both layouts); "
                    "2048 is train.pack_max_length's default")  # fmt: skip
    ap.add_argument("--models", default="tiny,8m", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default bench/RESULTS.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    names = args.models.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    batch, repeats = args.batch, args.repeats
    if args.quick:
        names, batch, budgets, repeats = ["tiny"], 32, [512], 1
    items = length_mix(batch, args.seed)
    rows, notes = [], []
    for name in names:
        for budget in budgets:
            res = bench_model(name, MODELS[name], items, budget, repeats, profile=not args.quick)
            real = res["real_tokens"]
            rows.append([
                name, f"{res['params'] / 1e6:.2f}M", budget, real, f"{res['micro_packed']} / {res['micro_padded']}",
                f"{100 * res['pad_fraction']:.0f}%", res["attn_ratio"], real / res["t_packed"],
                real / res["t_padded"], res["ratio"], f"{verdict(res['ratio'] >= TARGET)} (>= {TARGET}x)",
            ])  # fmt: skip
            for layout, top in res["profiles"].items():
                notes.append(f"- {name}, budget {budget}, {layout} step: {top}")
            print(f"packing ratio [{name}, budget {budget}]: packed/padded tokens/s = {res['ratio']:.2f}x "
                  f"(target >= {TARGET}x)")  # fmt: skip
    lens = [it.length for it in items]
    resp = sorted(len(it.response_ids) for it in items)
    body = (
        f"Global batch {batch} sequences (prompt U[10,40], response lognormal(3, 1) clipped to [1, 200]: "
        f"median {resp[len(resp) // 2]}, max {resp[-1]}; sequence lengths {min(lens)}-{max(lens)}), "
        f"{repeats} A/B repeats, vocab {VOCAB}, one step = fwd+bwd of rl_microbatch_loss over all micro-batches + "
        "AdamW. Padded = arrival-order groups with count x longest <= budget, [B, Lmax] batch with a padding mask. "
        "tokens/s counts real tokens only. attn ratio = efficient_attn_ratio of the packs (sum seq_len^2 / L^2): "
        "the share of the dense L x L attention a varlen kernel would compute.\n\n"
        + table(
            [
                "model",
                "params",
                "budget",
                "real tokens/step",
                "micro-batches packed / padded",
                "padding (padded)",
                "attn ratio",
                "packed tok/s",
                "padded tok/s",
                "ratio (median)",
                "target",
            ],
            rows,
        )  # fmt: skip
    )
    if notes:
        body += "\n\nProfile of one step where the target is missed (top ops by self CPU time):\n" + "\n".join(notes)
    write_section("Packing: packed vs padded training throughput", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
