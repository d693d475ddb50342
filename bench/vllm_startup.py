"""What a vLLM CPU server of a tiny model costs to start and to serve, per setting.

The suite starts a server per shared tiny model and per training that does not borrow one, on
fresh caches in CI. This bench starts the tests' server
(``cua_rl.testing.vllm_server.VLLMServer``) once per arm, with a fresh Inductor and vLLM cache
(``TORCHINDUCTOR_CACHE_DIR``, ``VLLM_CACHE_ROOT`` in a temp dir, as on a fresh CI machine) unless
``--warm``, and prints per arm: the seconds to ready, the CPU seconds of the server's process tree
until ready, and then the CPU and wall seconds of ``--requests`` chat completions of
``--tokens`` tokens each. Arms: ``default`` (the tests' server as it is), ``O0`` (vLLM's
optimization level 0), ``mp`` (the model in a worker process of its own, vLLM's default
executor: three processes) and ``uni`` (the model in the engine core's process, as the CPU
harness runs it: two).

    python bench/vllm_startup.py [--model qwen2-vl-bpe] [--arms default O0] [--requests 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cua_rl.testing.cache import ensure_model  # noqa: E402
from cua_rl.testing.vllm_server import VLLMServer  # noqa: E402

ARMS = {
    "default": [],
    "O0": ["--optimization-level", "0"],
    "mp": ["--distributed-executor-backend", "mp"],
    "uni": ["--distributed-executor-backend", "uni"],
}
# vLLM's CPU platform turns "uni" back into "mp" unless V1 multiprocessing is off; off, the API
# server still runs its engine core in a process of its own (AsyncLLM always does).
ARM_ENV = {
    "mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "uni": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}


def tree_cpu(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            continue
    return total


def run_arm(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    env = {}
    if not args.warm:
        cache = Path(tempfile.mkdtemp(prefix=f"vllm-startup-{name}-"))
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "VLLM_CACHE_ROOT": str(cache)}
    env.update(ARM_ENV.get(name, {}))
    server = VLLMServer(model_dir, extra_args=ARMS[name], env=env)
    t0 = time.monotonic()
    server.start()
    try:
        ready_s = time.monotonic() - t0
        start_cpu = tree_cpu(server.process.pid)
        body = {
            "model": server.model,
            "messages": [{"role": "user", "content": "Tap the middle of the screen."}],
            "max_tokens": args.tokens,
            "temperature": 1.0,
            "logprobs": True,
        }
        t1 = time.monotonic()
        for _ in range(args.requests):
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300)
            r.raise_for_status()
        serve_s = time.monotonic() - t1
        serve_cpu = tree_cpu(server.process.pid) - start_cpu
    finally:
        server.stop()
    return dict(
        arm=name, ready_s=ready_s, start_cpu=start_cpu, serve_s=serve_s, serve_cpu=serve_cpu
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2-vl-bpe", help="a tiny model (cua_rl.testing)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warm", action="store_true", help="keep the machine's caches")
    args = ap.parse_args(argv)
    model_dir = ensure_model(args.model)
    rows = [run_arm(name, model_dir, args) for name in args.arms]
    print(f"{'arm':<8} {'ready s':>8} {'start CPU s':>12} {'serve s':>8} {'serve CPU s':>12}")
    for r in rows:
        print(
            f"{r['arm']:<8} {r['ready_s']:>8.1f} {r['start_cpu']:>12.1f} "
            f"{r['serve_s']:>8.1f} {r['serve_cpu']:>12.1f}"
        )
    if len(rows) > 1:
        base = rows[0]
        for r in rows[1:]:
            print(
                f"{r['arm']} / {base['arm']}: start CPU {r['start_cpu'] / base['start_cpu']:.2f}x, "
                f"serve CPU {r['serve_cpu'] / max(base['serve_cpu'], 1e-9):.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
