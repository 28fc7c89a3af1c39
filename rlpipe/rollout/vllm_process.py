"""A vLLM OpenAI-compatible server that rlpipe starts, health-checks, restarts and stops.

vLLM pins its own torch/transformers, so it runs from its own venv (`scripts/setup_vllm.sh`) as a separate process:
the production shape anyway (a server beside the trainer). The server's output goes to a log file that is kept;
start-up failures quote its tail. `VLLM_SERVER_DEV_MODE=1` enables the admin routes a weight sync needs
(`/collective_rpc`, `/reset_prefix_cache`, `/pause`, `/resume`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rlpipe.errors import ConfigError, RolloutServerError

DEFAULT_VENV_PYTHON = ".venv-vllm/bin/python"


@dataclass
class VLLMServerSpec:
    """How to start the server (one process; the model directory may change on restart)."""

    python: str
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    dtype: str = "float32"
    max_model_len: int = 512
    kv_cache_gib: float = 1.0  # CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.5
    logprobs_mode: str = "processed_logprobs"
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING for LoRA, or
    # the server's CPU cores (VLLM_CPU_OMP_THREADS_BIND: replicas sharing a CPU node need it; all bind core 0 by default)
    cpus: tuple[int, ...] = ()  # cores the server and all its processes may run on (`taskset -c`); () = any.
    # VLLM_CPU_OMP_THREADS_BIND pins only the compute threads: the API server and engine-core loop still roam
    log_path: str = "vllm-server.log"
    startup_timeout_s: float = 600.0

    def command(self, port: int) -> list[str]:
        """The server command line (public so tests and docs can see exactly what runs); with `cpus`, under
        `taskset`, so the server and every process it starts stay on those cores."""
        pin = ["taskset", "-c", ",".join(str(c) for c in self.cpus)] if self.cpus else []
        return [
            *pin,
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", self.served_model_name,
            "--host", self.host, "--port", str(port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--logprobs-mode", self.logprobs_mode,
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--disable-log-stats",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.kv_cache_gib))))
        env["VLLM_SERVER_DEV_MODE"] = "1"  # admin routes for weight sync
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(self.extra_env)
        env.pop("PYTHONPATH", None)  # the server's venv must not import the trainer's packages
        return env


def resolve_vllm_python(configured: str | None, repo_root: Path | None = None) -> str:
    """The python of the vLLM venv: the config's, else $RLPIPE_VLLM_PYTHON, else `.venv-vllm/bin/python`."""
    candidate = configured or os.environ.get("RLPIPE_VLLM_PYTHON")
    if not candidate:
        root = repo_root or Path(__file__).resolve().parents[2]
        candidate = str(root / DEFAULT_VENV_PYTHON)
    if not Path(candidate).is_file():
        raise ConfigError(
            f"rollout.engine=vllm: no python at {candidate!r} for the vLLM server. Run `bash scripts/setup_vllm.sh` "
            "(creates .venv-vllm), or set rollout.vllm.python / $RLPIPE_VLLM_PYTHON, or give rollout.server_url "
            "of a running server."
        )
    return candidate


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention supports (vllm/v1/attention/backends/cpu_attn.py); others crash at the
first request, after a full start-up."""
CPU_STEP_TOKENS = 8192  # tokens per engine step on CPU without chunked prefill (prompts are never split)


def check_cpu_head_dim(model_dir: str) -> None:
    """Fail before a minute of server start-up when a CPU vLLM server could not run this model's attention."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    if head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        raise ConfigError(
            f"rollout.engine=vllm on CPU: the model in {model_dir} has head_dim {head_dim}, but vLLM's CPU attention "
            f"supports only {list(CPU_HEAD_DIMS)}. For the tiny default set model.tiny.num_heads so that "
            "hidden_size / num_heads is one of them (the default 64 / 2 = 32 works)."
        )


def cpu_server_args(max_model_len: int) -> list[str]:
    """Arguments a CPU vLLM server needs for rlpipe's seeded requests: no chunked prefill.

    rlpipe sends a sampling seed per prompt (reproducible rollouts). With chunked prefill, a prompt split across
    engine steps has its first sampled token discarded, and vLLM 0.32 then rewinds that request's generator with
    `set_offset`, which a CPU generator does not have: the engine core dies (`RuntimeError: CPU Generator does not
    use offset`; measured: SmolLM2 with 64 prompts of ~160 tokens, more than one step's 2048-token budget). Without
    chunked prefill every prompt is prefilled in one step; the step budget must hold the longest one.
    """
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, CPU_STEP_TOKENS))]


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """One managed server process. `start()` returns once `/health` answers; `stop()` always reaps it."""

    def __init__(self, spec: VLLMServerSpec, log=print):
        self.spec = spec
        self.log = log
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RolloutServerError("vLLM server is not started")
        return f"http://{self.spec.host}:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, model_dir: str | None = None) -> None:
        """Start (or restart, from `model_dir` if given) and wait until healthy; raise with the log's tail if not."""
        self.stop()
        if model_dir is not None:
            self.spec.model_dir = model_dir
        self.port = self.spec.port or _free_port(self.spec.host)
        log_path = Path(self.spec.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(log_path, "ab") as log_file:
            log_file.write(f"\n==== rlpipe: start {self.starts}: {' '.join(self.spec.command(self.port))}\n".encode())
            log_file.flush()
            self.process = subprocess.Popen(
                self.spec.command(self.port),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.spec.environment(),
                start_new_session=True,  # its engine-core children die with the group on stop()
            )
        self.log(f"vLLM server starting on {self.base_url} (pid {self.process.pid}, log {log_path})")
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        start = time.monotonic()
        while time.monotonic() - start < self.spec.startup_timeout_s:
            if not self.alive():
                code = self.process.returncode if self.process else None
                self.process = None
                raise RolloutServerError(
                    f"vLLM server exited during start-up (code {code}); log {self.spec.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.log(f"vLLM server ready on {self.base_url} after {time.monotonic() - start:.0f} s")
                return
            time.sleep(1.0)
        tail = self.log_tail()
        self.stop()
        raise RolloutServerError(
            f"vLLM server not healthy after {self.spec.startup_timeout_s:.0f} s; log {self.spec.log_path}:\n{tail}"
        )

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = Path(self.spec.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `timeout_s`; idempotent."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue
        print(f"vLLM server pid {proc.pid} did not exit", file=sys.stderr)
