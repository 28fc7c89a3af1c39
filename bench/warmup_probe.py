"""Where RL starts: exact sampled (T=1) and greedy accuracy of the warm-started tiny model per warm-up length.

Why: the learning proof must start from a policy that sometimes succeeds but is far from solved (mean reward
<= 0.3). This probe picks `model.warmup_sft_steps`: for each step count it builds the tiny default model exactly as
the pipeline does (`prepare_base_model`) and scores held-out RL prompts by teacher forcing, with no sampling noise:
sampled accuracy = mean over prompts of p(answer + EOS | prompt), the expected exact-match reward at T=1; greedy
accuracy = fraction of prompts whose answer is the argmax path. A big gap (greedy >> sampled) means RL mostly has
to sharpen; both low means RL has to find answers the warm-up did not teach.

Run: `.venv/bin/python bench/warmup_probe.py --steps 100 150 180 200 250` (about 15 s per step count on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import table, write_section  # noqa: E402


def accuracies(model_dir: str, task: str, seed: int, n: int) -> tuple[float, float]:
    """(sampled, greedy) exact-match accuracy on `n` prompts of the RL prompt set (seed `seed`)."""
    import torch

    from rlpipe.data.builtin_tasks import write_task_dataset
    from rlpipe.data.sft import load_sft_dataset
    from rlpipe.models.loading import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir, "float32", "cpu").eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_task_dataset(task, n, seed, Path(tmp) / "probe.jsonl", kind="sft")
        examples = load_sft_dataset(path, tokenizer, 128).examples
    sampled, greedy = 0.0, 0.0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.prompt_ids + ex.response_ids])
            logits = model(ids).logits[0, len(ex.prompt_ids) - 1 : -1].float()
            target = torch.tensor(ex.response_ids)
            sampled += torch.log_softmax(logits, -1).gather(1, target[:, None]).sum().exp().item()
            greedy += float((logits.argmax(-1) == target).all())
    return sampled / len(examples), greedy / len(examples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[100, 150, 180, 200, 250], help="warm-up lengths")
    ap.add_argument("--prompts", type=int, default=256, help="RL prompts scored per model")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--quick", action="store_true", help="one 5-step warm-up, 16 prompts (smoke test)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    ap.add_argument("--results", type=Path, default=None, help="markdown file to append to (default RESULTS.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts = [5], 16
    from rlpipe.base_model import prepare_base_model
    from rlpipe.config import load_config, parse_override

    rows = []
    with tempfile.TemporaryDirectory(prefix="rlpipe-probe-") as tmp:
        for steps in args.steps:
            sets = {**dict(parse_override(o) for o in args.set), "output_dir": tmp, "model.warmup_sft_steps": steps}
            cfg = load_config(overrides=sets)
            model_dir = prepare_base_model(cfg, log=lambda *a, **k: None)
            sampled, greedy = accuracies(model_dir, cfg.data.task, cfg.data.seed, args.prompts)
            print(f"warm-up {steps} steps: sampled {sampled:.3f}, greedy {greedy:.3f}", flush=True)
            rows.append([steps, sampled, greedy])
    if not args.no_record:
        body = (
            f"Task `{cfg.data.task}`, tiny default model, warm-up lr {cfg.model.warmup_sft_lr}, batch "
            f"{cfg.model.warmup_sft_batch_size}; {args.prompts} RL prompts scored exactly by teacher forcing "
            "(sampled = expected exact-match reward at T=1).\n\n"
            + table(["warm-up SFT steps", "sampled accuracy", "greedy accuracy"], rows)
            + f"\n\nThe default is `model.warmup_sft_steps={load_config().model.warmup_sft_steps}`.\n"
        )
        write_section("Warm-up probe: where RL starts", body, args.results, __file__, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
