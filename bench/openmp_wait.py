"""What OpenMP's wait policy costs on a busy 2-core machine: the suite's and the CPU demo's case.

torch runs its CPU kernels on an OpenMP team (libgomp, one thread per core by default). Between
parallel regions the team's threads spin for a while before they sleep (``OMP_WAIT_POLICY``
unset), which on an idle machine saves a wake-up and on a busy one burns a core that another
process (a trainer, a vLLM server, another pytest process) needs. ``make test`` runs five pytest
processes side by side on two cores, so every torch process there is on a busy machine.

This bench runs one torch-heavy test selection (the actor's recompute and vision tests on the
tiny Qwen2.5-VL by default) in a fresh pytest process per arm, quiet and then beside ``--load``
processes that each spin one core (the other pytest processes' stand-in), with the wait policy
unset and PASSIVE; it prints each arm's wall and CPU seconds (user + system of the pytest
process and its children) and the PASSIVE/unset ratios.

    python bench/openmp_wait.py [--load 2] [-- pytest arguments]
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
DEFAULT_TESTS = [
    "tests/areal/test_recompute.py",
    "tests/areal/test_vision_dedup.py",
    "-k",
    "qwen2.5-vl",
]
SPIN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def run_arm(tests: list[str], policy: str | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one pytest process over ``tests`` with that wait policy."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"pytest failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--load", type=int, default=2, help="processes spinning a core each, beside")
    ap.add_argument("tests", nargs="*", help="after --: pytest arguments (default: the actor's)")
    args = ap.parse_args(argv)
    tests = args.tests or DEFAULT_TESTS
    print(f"[openmp-wait] pytest {' '.join(tests)}; {os.cpu_count()} cores", flush=True)
    results: dict[tuple[str, str], tuple[float, float]] = {}
    for load in ("quiet", "busy"):
        spinners = []
        if load == "busy":
            # Each spins until killed (the deadline only guards against a bench that dies).
            code = SPIN.format(s=3600)
            spinners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(args.load)]
        try:
            for policy in ("unset", "PASSIVE"):
                wall, cpu = run_arm(tests, None if policy == "unset" else policy)
                results[(load, policy)] = (wall, cpu)
                print(f"  {load:<5} {policy:<8} wall {wall:6.1f} s  CPU {cpu:6.1f} s", flush=True)
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    print(f"{'machine':<8} {'wall PASSIVE/unset':>19} {'CPU PASSIVE/unset':>18}")
    for load in ("quiet", "busy"):
        (w0, c0), (w1, c1) = results[(load, "unset")], results[(load, "PASSIVE")]
        print(f"{load:<8} {w1 / w0:>19.2f} {c1 / c0:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
