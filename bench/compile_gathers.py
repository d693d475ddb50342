"""What AReaL's compiled log-prob gathers cost a CPU worker, as AReaL compiles them and dynamic.

Every actor worker of a CPU run calls ``gather_logprobs`` and ``gather_logprobs_entropy``
(areal/utils/functional/vocab_parallel.py), which AReaL wraps in torch.compile with its defaults:
the first call's shapes compiled static, the next shape again, dynamic; on CPU each compile
builds C++ kernels. ``--processes`` processes per arm, one after another as a suite's trainings
are, each calling both gathers on ``--calls`` lengths of its own (every training's batches have
other lengths), with one fresh inductor cache per arm (as on a fresh CI machine) that its
processes share. Arms: ``areal`` (AReaL's compile) and ``dynamic`` (the CPU harness's:
cua_rl/cpu/training.py ``compile_gathers_dynamic``). Prints each process's CPU seconds (its
children, the compiler's runs, included) and the arms' ratio.

    python bench/compile_gathers.py [--processes 4] [--calls 3] [--vocab 1024]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys, torch
    from areal.utils.functional import vocab_parallel as vp
    from cua_rl.cpu.training import GATHERS, compile_gathers_dynamic

    arm, first, calls, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if arm == "dynamic":
        compile_gathers_dynamic()
    for i in range(calls):
        n = first + 17 * i
        logits = torch.randn(n, vocab, dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n,))
        for name in GATHERS:
            getattr(vp, name)(logits, labels, 1.0)
""")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_arm(arm: str, args: argparse.Namespace) -> list[float]:
    costs = []
    with tempfile.TemporaryDirectory(prefix=f"inductor-{arm}-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        for p in range(args.processes):
            before = children_cpu()
            subprocess.run(
                [sys.executable, "-c", CHILD, arm, str(100 + 31 * p), str(args.calls),
                 str(args.vocab)],
                cwd=ROOT, env=env, check=True, capture_output=True,
            )  # fmt: skip
            costs.append(children_cpu() - before)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--calls", type=int, default=3, help="lengths per process")
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    totals = {}
    for arm in ("areal", "dynamic"):
        costs = run_arm(arm, args)
        totals[arm] = sum(costs)
        print(f"{arm:8s} per process CPU s: {' '.join(f'{c:5.1f}' for c in costs)}"
              f"   total {totals[arm]:6.1f}", flush=True)  # fmt: skip
    print(f"dynamic / areal: {totals['dynamic'] / totals['areal']:.2f}x CPU seconds")


if __name__ == "__main__":
    main()
