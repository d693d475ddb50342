"""What starting a CPU run's AReaL workers costs, cold and forked from a zygote.

A CPU run's workers each import AReaL, torch, transformers and the model's classes before they
serve (cua_rl/cpu/warm_start.py ``PRELOAD`` and ``model_modules``). Cold: ``--workers``
processes each import them. Warm: one zygote imports them, then forks a worker per stand-in
(``python -m cua_rl.cpu.rpc_worker``, as AReaL's scheduler starts it); each fork runs a no-op
entry instead of AReaL's RPC server, so what is measured is the start alone. Prints the CPU
seconds of each arm (this process's children and theirs, every one reaped) and their ratio.

    python bench/warm_start.py [--workers 2] [--model qwen2-vl-bpe] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cua_rl.cpu.warm_start import ENV_ZYGOTE, PRELOAD, Zygote, model_modules  # noqa: E402
from cua_rl.testing.cache import ensure_model  # noqa: E402

# The forks' entry: returns at once (``os.getpid`` takes no argument and raises nothing).
NO_OP = "os:getpid"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cold(modules: list[str], workers: int) -> tuple[float, float]:
    code = f"import importlib\nfor m in {modules!r}: importlib.import_module(m)"
    c0, t0 = children_cpu(), time.monotonic()
    for _ in range(workers):
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return children_cpu() - c0, time.monotonic() - t0


def warm(model_dir: str, workers: int) -> tuple[float, float]:
    c0, t0 = children_cpu(), time.monotonic()
    zygote = Zygote(model=model_dir, entry=NO_OP).start()
    try:
        env = {**os.environ, ENV_ZYGOTE: zygote.address}
        for _ in range(workers):
            subprocess.run(
                [sys.executable, "-m", "cua_rl.cpu.rpc_worker", "--role", "bench"],
                cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
    finally:
        zygote.stop()
    return children_cpu() - c0, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="workers per run (actor, rollout)")
    ap.add_argument("--model", default="qwen2-vl-bpe", help="a tiny model of cua_rl.testing.cache")
    ap.add_argument("--repeat", type=int, default=2, help="runs per arm (the best is printed)")
    args = ap.parse_args(argv)
    model_dir = str(ensure_model(args.model))
    modules = [*PRELOAD, *model_modules(model_dir)]
    print(f"[warm-start] {args.workers} workers importing {len(modules)} modules; "
          f"{os.cpu_count()} cores", flush=True)  # fmt: skip
    results = {}
    for name, arm in (("cold", lambda: cold(modules, args.workers)),
                      ("warm", lambda: warm(model_dir, args.workers))):  # fmt: skip
        runs = [arm() for _ in range(args.repeat)]
        for cpu, wall in runs:
            print(f"  {name}: {cpu:6.1f} CPU s, {wall:6.1f} s wall", flush=True)
        results[name] = min(runs)
    (c_cold, _), (c_warm, _) = results["cold"], results["warm"]
    print(f"workers {args.workers}: cold {c_cold:.1f} CPU s, warm {c_warm:.1f} CPU s, "
          f"warm/cold {c_warm / c_cold:.2f}, saved {c_cold - c_warm:.1f} CPU s per run")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
