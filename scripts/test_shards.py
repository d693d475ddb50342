"""``make test``'s runner: the suite as two pytest processes side by side.

Most of the suite's wall time goes to a few whole trainings, and they leave a 2-core machine half
idle (they wait on the sim agent's step latency, box start-up and the trainer's polls: a serial
run averaged 0.43 busy cores). The longest ones that share no fixture with the rest (the proof
of learning, the curriculum's restart run, the Ray and Slurm trainings of tests/cluster) share no fixture with the rest, so they run in a second process beside the main
one. The main process streams as usual; the second one's output goes to a log file and is
printed when both have ended. The exit status is the first failing process's. Two trainings at
once on one machine are safe only because AReaL's port choice no longer follows the training
seed (cua_rl/areal/ports.py): before that, trainings of one config drew the same ports.

    python scripts/test_shards.py [--log PATH] [-- extra pytest args for both]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Whole trainings that need nothing the rest of the suite builds (no shared vLLM server, no demo).
BESIDE = ("tests/app/test_learn.py", "tests/curriculum/test_in_the_loop.py", "tests/cluster")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--log",
        type=Path,
        default=ROOT / ".cache" / "test-logs" / "beside.log",
        help="where the second process writes its output",
    )
    ap.add_argument("pytest_args", nargs="*", help="passed to both pytest processes")
    args = ap.parse_args(argv)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "pytest", "-ra", *args.pytest_args]
    main_cmd = [*py, "--durations=15", *(f"--ignore={p}" for p in BESIDE)]
    beside_cmd = [*py, "--durations=5", *BESIDE]
    print(f"[tests] {' '.join(BESIDE)} run beside the rest; their output: {args.log}", flush=True)
    start = time.monotonic()
    with open(args.log, "w") as log:
        beside = subprocess.Popen(
            beside_cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            main_rc = subprocess.call(main_cmd, cwd=ROOT)
            if beside.poll() is None:
                print("[tests] waiting for the tests beside ...", flush=True)
            beside_rc = beside.wait()
        except BaseException:
            # Ctrl-C or a kill of make: take the second process's whole tree down with us.
            _kill_group(beside)
            raise
    print(f"\n[tests] ===== output of the tests beside ({args.log}) =====", flush=True)
    sys.stdout.write(args.log.read_text(errors="replace"))
    took = time.monotonic() - start
    verdict = "passed" if main_rc == beside_rc == 0 else "FAILED"
    print(f"[tests] {verdict}: main exit {main_rc}, beside exit {beside_rc}, {took:.0f} s wall")
    return main_rc or beside_rc


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    sys.exit(main())
