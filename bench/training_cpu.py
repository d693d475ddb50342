"""Where one whole training's CPU goes: the suite's trainings are its cost (tests/README.md), and
on two cores the wall time follows the CPU seconds they spend, not their count.

Runs ``make demo``'s launcher (``python -m cua_rl.app.demo --quiet``, any overrides after ``--``)
and samples its whole process tree every ``--every`` seconds with psutil: each process's user and
system CPU seconds (the last sample of a process that ends before the next one is what it is
credited with, so short-lived processes are undercounted by at most one interval each). Printed:
CPU seconds per role (the vLLM server, AReaL's workers, the trainer, the launcher, the gym, the
agent, the monitor, other), the process count of each, the total against the wall time (mean
cores busy), and what starting one Python process that imports torch, transformers and AReaL
costs here, times the processes of the run that did (the share of start-up in the total).

    python bench/training_cpu.py [--every 0.5] [--run-dir DIR] [-- demo arguments and overrides]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# (role, a part of the command line that names it), the first match wins.
ROLES = (
    ("vLLM server", "vllm"),
    ("AReaL worker", "rpc_worker"),
    ("AReaL worker", "rpc_server"),
    ("compiler", "cc1plus"),
    ("trainer", "examples.cua_agent.train"),
    ("gym", "cua_rl.sim gym"),
    ("agent", "cua_rl.sim agent"),
    ("monitor", "cua_rl.monitor"),
    ("launcher", "cua_rl.app.demo"),
)
HEAVY_IMPORTS = "import torch, transformers, areal"


def role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    for name, mark in ROLES:
        if mark in text:
            return name
    return "other"


def import_cost() -> float:
    """CPU seconds of a Python process that imports torch, transformers and AReaL, then exits."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", HEAVY_IMPORTS], check=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--run-dir", type=Path, help="the demo's run folder (default: a temp dir)")
    ap.add_argument("demo_args", nargs="*", help="after --: the demo's arguments and overrides")
    args = ap.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="training-cpu-")) / "run"
    cmd = [sys.executable, "-m", "cua_rl.app.demo", "--quiet", "--run-dir", str(run_dir)]
    cmd += args.demo_args
    print(f"[training-cpu] {' '.join(cmd)}", flush=True)
    seen: dict[int, tuple[str, float, bool]] = {}  # pid -> (role, cpu s, imports torch)
    commands: dict[int, str] = {}
    start = time.monotonic()
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    root = psutil.Process(launcher.pid)
    while launcher.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc in procs:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu = times.user + times.system
                    if proc.pid not in seen:
                        heavy = any("torch" in m.path for m in proc.memory_maps(grouped=True))
                        seen[proc.pid] = (role(proc.cmdline()), cpu, heavy)
                        commands[proc.pid] = " ".join(proc.cmdline())[:100]
                    else:
                        name, _, heavy = seen[proc.pid]
                        if not heavy and cpu > 5:
                            heavy = any("torch" in m.path for m in proc.memory_maps(grouped=True))
                        seen[proc.pid] = (name, cpu, heavy)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(args.every)
    wall = time.monotonic() - start
    rc = launcher.wait()
    by_role: dict[str, list[float]] = defaultdict(list)
    for name, cpu, _ in seen.values():
        by_role[name].append(cpu)
    total = sum(cpu for _, cpu, _ in seen.values())
    print(f"[training-cpu] demo exit {rc}, wall {wall:.0f} s, run folder {run_dir}")
    print(f"{'role':<14} {'processes':>9} {'CPU s':>8} {'share':>6}")
    for name, cpus in sorted(by_role.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:<14} {len(cpus):>9} {sum(cpus):>8.1f} {sum(cpus) / total:>6.1%}")
    print(f"{'total':<14} {len(seen):>9} {total:>8.1f}   mean cores busy {total / wall:.2f}")
    others = sorted((cpu, commands[pid]) for pid, (n, cpu, _) in seen.items() if n == "other")
    for cpu, command in others[::-1][:8]:
        print(f"  other: {cpu:6.1f} s  {command}")
    heavy = sum(1 for _, _, h in seen.values() if h)
    one = import_cost()
    print(
        f"start-up: one process importing torch, transformers and AReaL costs {one:.1f} CPU s "
        f"here; {heavy} processes of the run loaded torch: about {heavy * one:.0f} CPU s "
        f"({heavy * one / total:.0%} of the total)"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
