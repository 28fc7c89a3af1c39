"""Engine replicas: 1 vs 2 vLLM CPU replicas on the same prompts and seeds, and what one sync costs.

Command (from the repo root; needs `bash scripts/setup_vllm.sh`, and `pip install -e ".[bench]"` for SmolLM2):

    RAY_AUTH_MODE=disabled PYTHONPATH=. .venv/bin/python bench/rollout_replicas.py

(a) Rollout tokens/s and sync time, tiny default model. One Ray node; each replica is an `EngineReplica` actor
    (`rlpipe.rollout.replica_actor`, what `rollout.vllm.replicas` starts) on its own core: every process of server i
    (API server, engine core, compute threads) is pinned to core i (`VLLMServerSpec.cpus`), its compute threads
    bind it (`VLLM_CPU_OMP_THREADS_BIND=<i>`: by default every CPU server binds core 0), and so is replica i's actor,
    the client that sends its requests and parses the answers. Without the pinning one replica's API server,
    engine-core loop and client use the other core, so "1 replica" would get more than one core. The trainer is idle during rollout:
    an HF copy of the model in this process takes one AdamW step between syncs and publishes the same way the
    training workers do (`serving_buffer` into the object store; each replica writes its node-local copy).
    Rollout: `ReplicaPool.generate` on `--prompts` prompts x `--n` samples x `--max-new-tokens`, the same seeds for
    both counts, median of `--repeats` (after one warm-up). The target ratio is paired: inside the 2-replica run,
    each repeat samples with replica 0 alone and with both, in alternating order (so drift in the machine's state
    hits both alike); the separately started 1-replica pool is reported beside it (two runs minutes apart differed
    by 30% on this machine). Sync: median `engine/sync_time_s` (publish once + the slowest replica's load and
    verification) over `--updates` updates, paired the same way: each update is synced by the pair or by replica 0
    alone, in alternating order.
(b) SmolLM2-135M: the sync time of one replica against the limit, writing and reading the model's bytes once on
    this machine (safetensors of the state dict into memory, a file in /dev/shm, read back).

Two cores: both replicas and the driver share them, so the 2-replica rollout can at best double; the sync of two
replicas loads in parallel on the two cores. The load average is recorded next to the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._common import table, write_section  # noqa: E402
from bench.sync_blind_spot import Trainer, _model_dir  # noqa: E402

SYNC_PARTS = ("engine/sync_time_s", "engine/publish_time_s", "engine/load_time_s", "engine/check_time_s",
              "engine/verify_time_s")  # fmt: skip


def start_pool(model_dir: str, replicas: int, trainer: Trainer):
    """`replicas` EngineReplica actors (server i on core i) behind a ReplicaPool fed by `trainer`."""
    import ray

    from rlpipe.rollout.engine_sync import EngineSync
    from rlpipe.rollout.probe import ProbeSequence
    from rlpipe.rollout.replica_actor import EngineReplica, RemoteEngine
    from rlpipe.rollout.replicas import ReplicaPool
    from rlpipe.rollout.serving_dir import model_dir_files, serving_buffer, serving_state_dict
    from rlpipe.rollout.vllm_process import VLLMServerSpec, cpu_server_args

    base = ray.put(model_dir_files(model_dir))
    actors = []
    for i in range(replicas):
        spec = VLLMServerSpec(python=str(HERE.parent / ".venv-vllm/bin/python"), model_dir=model_dir,
                              served_model_name="policy", max_model_len=256, extra_args=cpu_server_args(256),
                              extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count())},
                              cpus=(i % os.cpu_count(),))  # fmt: skip
        actors.append(ray.remote(EngineReplica).options(num_cpus=0).remote(spec, base, i, None))
    for i, actor in enumerate(actors):  # the replica's client side (HTTP, JSON) shares its server's core
        ray.get(actor.__ray_call__.remote(_pin_process, {i % os.cpu_count()}))
    engines = [RemoteEngine(a, i) for i, a in enumerate(actors)]

    def publish(version: int):
        state = serving_state_dict(trainer.model.state_dict(), "model.embed_tokens.weight", "lm_head.weight")
        return ray.put(serving_buffer(state))

    probe = [ProbeSequence(p.prompt_ids, p.response_ids) for p in trainer.probe]
    syncs = [EngineSync(e, None, None, probe, 1e-3, log=lambda m: None) for e in engines]
    return ReplicaPool(syncs, publish, trainer.probe_logprobs, probe, max_new_tokens=64, publish_ahead=True)


def _pin_process(_actor, cpus: set[int]) -> None:
    """Pin every thread of the calling actor's process to `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def measure(model_dir: str, replicas: int, args, work: Path) -> dict:
    trainer = Trainer(model_dir, work / f"unused-{replicas}", probe_tokens=16)
    pool = start_pool(model_dir, replicas, trainer)
    try:
        pools = paired_pools(pool)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, trainer.vocab, (16,), generator=gen).tolist() for _ in range(args.prompts)]
        syncs = sync_times(pools, trainer, args.updates)
        rates = rollout_rates(pools, prompts, trainer.version, args)
        parts = {k.removeprefix("engine/"): statistics.median(m[k] for m in syncs[replicas]) for k in SYNC_PARTS}
        out = {"tokens_per_s": rates[replicas], "sync_s": parts.pop("sync_time_s"), **parts}
        if replicas == 2:
            out["tokens_per_s_one_of_two"] = rates[1]
            out["sync_s_one_of_two"] = statistics.median(m["engine/sync_time_s"] for m in syncs[1])
        return out
    finally:
        pool.close()


def paired_pools(pool) -> dict:
    """{replica count: pool}: `pool`, and for a 2-replica pool also a pool over its replica 0 alone (the other one
    idle but running), for paired comparisons in which only the number of replicas at work differs."""
    from rlpipe.rollout.replicas import ReplicaPool

    pools = {len(pool.syncs): pool}
    if len(pool.syncs) == 2:
        pools[1] = ReplicaPool(pool.syncs[:1], pool.publish, pool.trainer_probe, pool.probe, pool.max_new_tokens,
                               publish_ahead=pool.publish_ahead, log=lambda m: None)  # fmt: skip
    return pools


def sync_times(pools: dict, trainer: Trainer, updates: int) -> dict[int, list[dict]]:
    """Each pool's sync metrics over `updates` updates of its own, interleaved (update k goes to the pair or to
    replica 0 alone, in alternating order); the first sync of each (from the base weights) is warm-up."""
    from rlpipe.rollout.engine_sync import SyncStats

    syncs: dict[int, list[dict]] = {k: [] for k in pools}
    for r in range(updates + 1):
        for k in sorted(pools, reverse=r % 2 == 1):
            trainer.step(1e-4)
            pools[k].stats = SyncStats()
            pools[k].ensure_current(trainer.version)
            if r > 0:
                syncs[k].append(pools[k].stats.sync_metrics())
    return syncs


def rollout_rates(pools: dict, prompts: list[list[int]], version: int, args) -> dict[int, float]:
    """Median rollout tokens/s of each pool (`paired_pools`), measured interleaved, in alternating order."""
    from rlpipe.rollout.engine import SamplingParams

    top = pools[max(pools)]
    top.ensure_current(version)  # replica 1 may be a version behind after `sync_times`
    rates: dict[int, list[float]] = {k: [] for k in pools}
    for r in range(args.repeats + 1):  # repeat 0 is warm-up
        params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=100 + r)
        for k in sorted(pools, reverse=r % 2 == 1):
            start = time.perf_counter()
            gens = pools[k].generate(prompts, params, version)
            rates[k].append(sum(len(g.response_ids) for g in gens) / (time.perf_counter() - start))
    return {k: statistics.median(v[1:]) for k, v in rates.items()}


def byte_limit(model_dir: str) -> dict:
    """Seconds to serialize SmolLM2's serving state, write it to /dev/shm and read it back: what a sync cannot beat."""
    from transformers import AutoModelForCausalLM

    from rlpipe.rollout.serving_dir import serving_buffer, serving_state_dict

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = serving_state_dict(model.state_dict(), "model.embed_tokens.weight", "lm_head.weight")
    times = []
    for _ in range(6):  # the first is warm-up: a fresh VM's first touch of its memory costs seconds per GiB
        start = time.perf_counter()
        data = serving_buffer(state)
        with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
            f.write(data)
            f.flush()
            f.seek(0)
            f.read()
        times.append(time.perf_counter() - start)
    return {"bytes": len(data), "limit_s": statistics.median(times[1:])}


def main(argv: list[str] | None = None) -> None:
    import ray

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--updates", type=int, default=9)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--only-smollm2", action="store_true", help="just the SmolLM2 sync against its limit")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    load_before = os.getloadavg()
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-replicas-") as tmp:
        tiny, _ = _model_dir("tiny", Path(tmp))
        for replicas in () if args.only_smollm2 else (1, 2):
            results[replicas] = measure(tiny, replicas, args, Path(tmp))
            print(replicas, results[replicas], flush=True)
            rows.append([f"{replicas} (own pool)", f"{results[replicas]['tokens_per_s']:.0f}",
                         f"{results[replicas]['sync_s']:.3f}"])  # fmt: skip
        if results:
            rows.insert(1, ["1 of the 2 (interleaved)", f"{results[2]['tokens_per_s_one_of_two']:.0f}",
                            f"{results[2]['sync_s_one_of_two']:.3f}"])  # fmt: skip
        smol = None
        if not args.skip_smollm2:
            smol_dir, _ = _model_dir("smollm2", Path(tmp))
            smol_args = argparse.Namespace(**{**vars(args), "repeats": 1, "prompts": 8})
            smol = {**byte_limit(smol_dir), **measure(smol_dir, 1, smol_args, Path(tmp))}
            print("smollm2", smol, flush=True)
    ray.shutdown()
    body = ""
    if results:
        speed = results[2]["tokens_per_s"] / results[2]["tokens_per_s_one_of_two"]
        own_pools = results[2]["tokens_per_s"] / results[1]["tokens_per_s"]
        sync_ratio = results[2]["sync_s"] / results[2]["sync_s_one_of_two"]
        sync_own_pools = results[2]["sync_s"] / results[1]["sync_s"]
        body = (
            f"Tiny default model, {args.prompts} prompts x {args.n} samples x {args.max_new_tokens} new tokens, vLLM "
            "CPU replicas as Ray actors, every process of server i pinned to core i, trainer idle during rollout; "
            "medians.\n\n"
            + table(["replicas", "rollout tokens/s", "sync time per update (s)"], rows)
            + f"\n\n2 replicas: rollout {speed:.2f}x one (target >= 1.7x; paired: the pair against its replica 0 "
            f"alone, interleaved in one run; against the separately started 1-replica pool {own_pools:.2f}x), sync "
            f"{sync_ratio:.2f}x one (target <= 1.3x; paired the same way, each update synced by the pair or by "
            f"replica 0 alone in turn; against the separate pool {sync_own_pools:.2f}x)."
        )
    if smol is not None:
        body += (
            f"\n\nSmolLM2-135M, one replica: sync {smol['sync_s']:.2f} s per update (publish {smol['publish_time_s']:.2f}"
            f" s: state dict to safetensors bytes into the object store, and the trainer's probe; load "
            f"{smol['load_time_s']:.2f} s: node-local write + vLLM reload + engine-side checks "
            f"{smol['check_time_s']:.2f} s; probe {smol['verify_time_s']:.2f} s, one batched request) against "
            f"{smol['limit_s']:.2f} s to "
            f"serialize, write and read its {smol['bytes'] / 2**20:.0f} MiB once ({smol['sync_s'] / smol['limit_s']:.1f}x"
            " the limit)."
        )
    body += f"\n\nLoad average (1/5/15 min) before {load_before}, after {os.getloadavg()}."
    print(body)
    if not args.no_write:
        write_section("Engine replicas: 1 vs 2 vLLM CPU replicas (issue 28)", body, None, __file__,
                      argv if argv is not None else sys.argv[1:])  # fmt: skip


if __name__ == "__main__":
    main()
