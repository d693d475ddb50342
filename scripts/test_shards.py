"""``make test``'s runner: the suite as pytest processes side by side.

Most of the suite's wall time goes to a few whole trainings, and they leave a 2-core machine half
idle (they wait on the sim agent's step latency, box start-up and the trainer's polls: a serial
run averaged 0.43 busy cores). The longest ones that share no fixture with the rest run in
processes beside the main one, a group each: the proof of learning, the curriculum's restart
run and the Ray and Slurm trainings of tests/cluster in one; the run-end trainings (the demo
ended four ways, a trainer killed outright) in another. The main process streams as usual; the
others' output goes to log files, printed when all have ended. The exit status is the first failing process's. Two trainings at
once on one machine are safe only because AReaL's port choice no longer follows the training
seed (cua_rl/areal/ports.py): before that, trainings of one config drew the same ports. The
trainings per family (tests/app/test_families_train.py) ride with the learning group, the
trainings per context policy (tests/app/test_context_train.py) and the training through a model
outage (tests/app/test_model_outage.py) ride with the run-end group, and so do the exports of a
training per context policy (tests/warehouse/test_export_consumers.py, three short trainings);
so do the PPO smoke steps and the GPU environments' resolutions, which wait on the package
registry (learning), and the evaluation-only run (run-end), which kept the main process the
longest (main 2,098 s, learning 1,823 s, run-end 1,842 s in a fresh-clone CI run).

    python scripts/test_shards.py [--log-dir DIR] [-- extra pytest args for every process]
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
# Whole trainings that need nothing the rest of the suite builds (no shared vLLM server, no demo),
# by group: each group is one pytest process beside the main one.
BESIDE = {
    "learning": (
        "tests/app/test_learn.py",
        "tests/curriculum/test_in_the_loop.py",
        "tests/cluster",
        "tests/app/test_families_train.py",
        "tests/cpu/test_ppo_smoke.py",
        "tests/inference/test_environments.py",
    ),
    "run-end": (
        "tests/app/test_run_end.py",
        "tests/monitor/test_safety_trainer_killed.py",
        "tests/app/test_context_train.py",
        "tests/app/test_model_outage.py",
        "tests/app/test_eval_only.py",
        "tests/warehouse/test_export_consumers.py",
    ),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / ".cache" / "test-logs",
        help="where the processes beside write their output (beside-<group>.log)",
    )
    ap.add_argument("pytest_args", nargs="*", help="passed to every pytest process")
    args = ap.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "pytest", "-ra"]
    every = [path for paths in BESIDE.values() for path in paths]
    # The caller's arguments come last, so that they override ours (e.g. --durations=0).
    # The slowest tests of each process are listed, so a CI log shows where the time went.
    main_cmd = [*py, "--durations=30", *(f"--ignore={p}" for p in every), *args.pytest_args]
    start = time.monotonic()
    beside: dict[str, tuple[subprocess.Popen, Path]] = {}
    main_proc: subprocess.Popen | None = None
    try:
        for group, paths in BESIDE.items():
            log = args.log_dir / f"beside-{group}.log"
            print(f"[tests] {' '.join(paths)} run beside the rest; their output: {log}", flush=True)
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [*py, "--durations=10", *paths, *args.pytest_args],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            beside[group] = (proc, log)
        main_proc = subprocess.Popen(main_cmd, cwd=ROOT)
        procs = {"main": main_proc, **{group: proc for group, (proc, _) in beside.items()}}
        ended: dict[str, float] = {}
        while len(ended) < len(procs):
            for name, proc in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic() - start
                    if name == "main" and len(ended) < len(procs):
                        print("[tests] waiting for the tests beside ...", flush=True)
            time.sleep(1)  # the wall times below are read to this second
        main_rc = main_proc.returncode
        codes = {group: proc.returncode for group, (proc, _) in beside.items()}
    except BaseException:
        # Ctrl-C or a kill of make: take the other processes' whole trees down with us.
        if main_proc is not None and main_proc.poll() is None:
            main_proc.kill()
            main_proc.wait()
        for proc, _ in beside.values():
            _kill_group(proc)
        raise
    for group, (_, log) in beside.items():
        print(f"\n[tests] ===== output of the tests beside: {group} ({log}) =====", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    took = time.monotonic() - start
    failed = main_rc != 0 or any(codes.values())
    exits = ", ".join(f"{group} exit {rc} ({ended[group]:.0f} s)" for group, rc in codes.items())
    print(
        f"[tests] {'FAILED' if failed else 'passed'}: main exit {main_rc} ({ended['main']:.0f} s), "
        f"{exits}, {took:.0f} s wall"
    )
    return main_rc or next((rc for rc in codes.values() if rc), 0)


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
