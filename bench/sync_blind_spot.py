"""The weight-sync probe's blind spot (issue 33): does an engine that skipped a load pass the probe?

One vLLM CPU server (float32: this CPU cannot serve bf16 reliably, so the bf16 tolerance 0.1 is applied to a float32
engine) on the tiny default model or SmolLM2-135M-Instruct (`--model smollm2`, imported once from the bench extra's
GGUF like `bench/smollm2.py`). For each learning rate the trainer (an HF model in this process) takes one AdamW
step on a GRPO-style loss and publishes the new version; the probe is scored by the engine before the load (stale)
and after it (synced), and judged by the absolute check (float32 tolerance 1e-3, bf16 tolerance 0.1), by the
relative check (`relative_probe`), and by the engine-side checksums (`VLLMEngine._check_load`).

Run (one server start each, ~2 and ~4 min on 2 idle cores; each writes its own section of bench/RESULTS.md):

    PYTHONPATH=. .venv/bin/python bench/sync_blind_spot.py --lrs 1e-6 1e-5 1e-4 1e-3
    PYTHONPATH=. .venv/bin/python bench/sync_blind_spot.py --model smollm2 --lrs 1e-7 1e-6 1e-5 --probe-tokens 64

`tests/integration/test_sync_checks_vllm.py` uses this module's harness.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlpipe.rollout.probe import ProbeSequence, compare_probe, default_probe_noise, relative_probe
from rlpipe.rollout.serving_dir import serving_state_dict, write_serving_dir

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = str(REPO / ".venv-vllm" / "bin" / "python")


class Trainer:
    """The tiny default model, one AdamW step at a time, publishing serving directories like `export_serving`."""

    def __init__(self, model_dir: str, root: Path, seed: int = 0, probe_tokens: int = 16):
        from transformers import AutoModelForCausalLM

        self.model_dir, self.root = model_dir, root
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.probe = [
            ProbeSequence(torch.randint(3, self.vocab, (4,), generator=self.gen).tolist(),
                          torch.randint(3, self.vocab, (probe_tokens,), generator=self.gen).tolist())
            for _ in range(4)
        ]  # fmt: skip
        self.version = 0

    def step(self, lr: float) -> None:
        """One AdamW step on -A * logprob of 8 random 20-token sequences with advantages +-1 (a GRPO-style update)."""
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        ids = torch.randint(3, self.vocab, (8, 20), generator=self.gen)
        adv = torch.tensor([1.0, -1.0] * 4)
        logp = torch.log_softmax(self.model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(adv[:, None] * logp).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.version += 1

    def publish(self, version: int | None = None) -> str:
        state = serving_state_dict(self.model.state_dict(), "model.embed_tokens.weight", "lm_head.weight")
        return str(write_serving_dir(state, self.model_dir, self.root, self.version if version is None else version))

    def probe_logprobs(self, seqs: list[ProbeSequence]) -> list[list[float]]:
        """log p(response token | prefix) from the logits, float64 (the trainer's side of the probe)."""
        out = []
        with torch.no_grad():
            for p in seqs:
                ids = p.prompt_ids + p.response_ids
                logits = self.model(torch.tensor([ids])).logits[0].double()
                lp = torch.log_softmax(logits, -1)
                out.append([float(lp[len(p.prompt_ids) + j - 1, t]) for j, t in enumerate(p.response_ids)])
        return out


def start_server(model_dir: str, log_path: str):
    from rlpipe.rollout.vllm_process import VLLMServer, VLLMServerSpec, cpu_server_args

    spec = VLLMServerSpec(python=VLLM_PYTHON, model_dir=model_dir, served_model_name="policy", max_model_len=256,
                          log_path=log_path, extra_args=cpu_server_args(256))  # fmt: skip
    server = VLLMServer(spec, log=lambda m: None)
    server.start()
    return server


def measure(engine, trainer: Trainer, lrs: list[float]) -> list[dict]:
    """Per lr: one step, then the probe of the stale engine (before the load) and of the synced one (after)."""
    rows = []
    engine.load_weights(trainer.publish(), trainer.version)
    for lr in lrs:
        old = trainer.probe_logprobs(trainer.probe)
        trainer.step(lr)
        new = trainer.probe_logprobs(trainer.probe)
        start = time.perf_counter()
        path = trainer.publish()
        row = {"lr": lr, "publish_s": time.perf_counter() - start}
        for state in ("stale", "synced"):
            if state == "synced":
                start = time.perf_counter()
                engine.load_weights(path, trainer.version)
                row["load_s"], row["check_s"] = time.perf_counter() - start, engine.last_check_s
                row.update(engine.last_check_metrics)
            start = time.perf_counter()
            eng = [engine.score(p.prompt_ids, p.response_ids) for p in trainer.probe]
            row[f"{state}_score_s"] = time.perf_counter() - start
            row[f"{state}_max"] = compare_probe(eng, new).max_abs_diff
            for tol_name, tol in (("fp32", 1e-3), ("bf16", 0.1)):
                rel = relative_probe(eng, new, old, default_probe_noise(tol))
                row[f"{state}_{tol_name}_sep"] = rel.separation
                row[f"{state}_{tol_name}_inconclusive"] = rel.inconclusive
        row["update_max"] = compare_probe(new, old).max_abs_diff
        rows.append(row)
    return rows


def _verdict(row: dict, state: str, tol_name: str, tol: float) -> str:
    absolute = "pass" if row[f"{state}_max"] <= tol else "FAIL"
    if row[f"{state}_{tol_name}_inconclusive"]:
        relative = "inconclusive"
    else:
        relative = "pass" if row[f"{state}_{tol_name}_sep"] >= 0 else "FAIL"
    return f"{absolute} / {relative} (sep {row[f'{state}_{tol_name}_sep']:+.2f})"


def _model_dir(name: str, tmp: Path) -> tuple[str, str]:
    """(directory, description) of the model to measure: the tiny default, or SmolLM2-135M imported once."""
    if name == "tiny":
        from rlpipe.models.tiny import create_tiny_model_dir

        return str(create_tiny_model_dir(tmp / "base")), "Tiny default model"
    from bench.smollm2 import default_model_dir, ensure_model

    return ensure_model(default_model_dir("float32"), "float32"), "SmolLM2-135M-Instruct (float32)"


def _body(rows: list[dict], model: str, probe_tokens: int) -> str:
    from bench._common import table

    verdicts = []
    for r in rows:
        for state in ("stale", "synced"):
            verdicts.append([f"{r['lr']:g}", f"{r['update_max']:.3g}", state, f"{r[f'{state}_max']:.3g}",
                             _verdict(r, state, "fp32", 1e-3), _verdict(r, state, "bf16", 0.1)])  # fmt: skip
    cost = []
    for r in rows:
        sync = r["publish_s"] + r["load_s"] + r["synced_score_s"]
        cost.append([f"{r['lr']:g}", f"{r['publish_s']:.3f}", f"{r['load_s']:.3f}", f"{r['check_s']:.3f}",
                     f"{r['synced_score_s']:.3f}", f"{r['check_s'] / sync:.1%}",
                     f"{r.get('engine/checksum_params_moved', float('nan')):g}"])  # fmt: skip
    return (
        f"{model}, vLLM CPU float32 engine, probe 4 x {probe_tokens} tokens; the bf16 column applies the bf16 "
        "tolerance (0.1) and noise (0.025) to this float32 engine. lrs are successive AdamW steps. Verdict = "
        "absolute check / relative check (separation: +1 synced, -1 stale). Before issue 33 only the absolute check "
        "ran.\n\n"
        + table(["lr", "update max", "engine", "max engine-trainer", "fp32 tol 1e-3", "bf16 tol 0.1"], verdicts)
        + "\n\nCost per sync (seconds): publish (write the serving dir), load incl. the engine-side checks "
        "(version read-back, one checksum call, the published tensors' digests), of which checks, and the probe "
        "scoring the absolute check already did; checks / sync = checks / (publish + load + probe).\n\n"
        + table(["lr", "publish", "load", "checks", "probe", "checks / sync", "params moved"], cost)
    )


def main(argv: list[str] | None = None) -> None:
    from bench._common import write_section
    from rlpipe.rollout.vllm_engine import VLLMEngine

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4, 1e-3])
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlpipe-blind-") as tmp:
        model_dir, model = _model_dir(args.model, Path(tmp))
        server = start_server(model_dir, str(Path(tmp) / "vllm.log"))
        try:
            engine = VLLMEngine(server.base_url, "policy", None)
            trainer = Trainer(model_dir, Path(tmp) / "serving", probe_tokens=args.probe_tokens)
            rows = measure(engine, trainer, args.lrs)
        finally:
            server.stop()
    body = _body(rows, model, args.probe_tokens) + f"\n\nLoad average (1/5/15 min) at the end: {os.getloadavg()}."
    print(body)
    if not args.no_write:
        write_section(f"Weight-sync blind spot, {args.model}: stale vs synced engine (issue 33)", body, args.results,
                      __file__, argv if argv is not None else sys.argv[1:])  # fmt: skip


if __name__ == "__main__":
    main()
