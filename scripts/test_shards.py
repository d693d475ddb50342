"""``make test``'s runner: the suite as pytest processes side by side, and what it spent.

Most of the suite's wall time goes to whole trainings (AReaL's launcher, its workers, a vLLM CPU
server), and a training leaves a 2-core machine half idle (it waits on box start-up, the agent's
settle time and the trainer's polls): the longest ones run in processes beside the main one, a
group each. Tests that read one of the session's shared trainings (tests/conftest.py
``shared_training``) run in one process, the one that trains it; each process that trains
starts its own shared vLLM server per tiny model (``model_servers``), borrowed by its trainings
one after another. The main process streams as usual; the others' output goes to log files,
printed when all have ended. Two trainings at once on one machine are safe because AReaL's port
choice no longer follows the training seed (cua_rl/areal/ports.py).

At the end it prints, from every process: the slowest tests, every whole training and shared
server with its wall time and CPU seconds (``note_cost`` in tests/conftest.py; tests/README.md
keeps the budget), the tests that cost the most CPU seconds, and each process's wall time and CPU
seconds (its whole tree, sampled: cua_rl/testing/cpu_meter.py). On two busy cores the CPU seconds
are the cost that adds up; a training's wall time also says what ran beside it. The exit status
is the first failing process's.

    python scripts/test_shards.py [--log-dir DIR] [-- extra pytest args for every process]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from cua_rl.testing.cpu_meter import TreeCPU

ROOT = Path(__file__).resolve().parents[1]
# Test files (or node ids) by group: each group is one pytest process beside the main one, which
# runs everything else. Every file that reads a shared training is in the group that trains it.
BESIDE = {
    # The shared trainings (the demo's own, the built-in MAI-UI loop, the current-only agent,
    # the agent functions of one's own) and every test that reads them.
    "shared": (
        "tests/app/test_train_local.py",
        "tests/app/test_function_train.py",
        "tests/monitor/test_dashboard_browser.py",
        "tests/app/test_context_train.py",
        "tests/warehouse/test_export_consumers.py",
        "tests/app/test_run_end.py::test_a_run_ending_on_a_busy_machine_leaves_no_execution_and_no_open_record",
        # Two trainings of a user's workflow subclass, borrowing this process's shared server.
        "tests/app/test_hooks_train.py",
        # The Slurm training (its own daemons and server; `make test` installs Slurm): this
        # process ended 200-460 s before the others without it.
        "tests/cluster/test_slurm_training.py",
    ),
    # Trainings that must end a particular way (SIGTERM, fail-fast, a killed trainer, an outage,
    # a crash at start), the evaluation-only run and the audit's training, then one training per
    # model family: trainings of one model next to each other, as the process keeps one shared
    # server at a time (tests/conftest.py MAX_SHARED_SERVERS). At the end of parts instead, they
    # met the other processes' trainings and the whole suite took 3,150 CPU s instead of 2,604
    # (memory: 3 GiB of 24 left; a fresh clone, 2026-11-28).
    # With main at nice -5, main ended 650 s before ends, the last (fresh clones, 2026-11-29,
    # evening). With the SIGTERM run (its own demo, server and zygote) in main too, the tests took
    # 2,616 s and 4,585 CPU s instead of 2,340 and 4,023 (one fresh clone; the machine's spread
    # may be part of it): it stays here.
    "ends": (
        "tests/app/test_run_end.py::test_sigterm_mid_run_cancels_the_training_and_stops_every_worker",
        "tests/app/test_run_end.py::test_systematic_rejection_stops_the_training_failed_with_its_reason",
        "tests/app/test_model_outage.py",
        "tests/monitor/test_safety_trainer_killed.py",
        "tests/app/test_eval_only.py",
        "tests/audit/test_free_reward_training.py",
        "tests/app/test_train_local.py::test_a_crashing_run_leaves_the_training_failed_with_its_error",
        "tests/app/test_families_train.py",
    ),
    # The proof of learning and the curriculum's restart (long trainings borrowing one server),
    # the Ray trainings and AReaL's own PPO smoke steps.
    "learning": (
        "tests/app/test_learn.py",
        "tests/curriculum/test_in_the_loop.py",
        "tests/cluster",
        "tests/cpu/test_ppo_smoke.py",
    ),
    # Part of what the main process ran alone once the trainings had ended, one core idle: the
    # folders whose tests start no vLLM server (the actor's, the gym's, the audit's, the
    # monitor's, the credit's, the CPU harness's, the curriculum's, the benches'). With the
    # agent's, the gateway's and the model server's tests too, this process held three vLLM
    # servers beside main's and the trainings' and the machine's available memory fell to 0.3
    # GiB of 24. With the first two folders only, it ended at 715 s of 2,044 and main ran alone
    # for its last 230 s (a fresh clone, 2026-11-28). With all of these folders it ended at 878 s
    # of 1,555, main last, so the launcher's config, check and harness tests (no vLLM server
    # either: each starts the launcher as a user runs it) run here too. On 2026-11-29 main still
    # ended 240 s after the last other process (a fresh clone of 1d9eaf3: main 2,452 s, ends
    # 2,206, parts 1,629), one core idle meanwhile: four files of main's that start no server
    # (85 CPU s, measured with the per-test costs) moved here, and from learning, which ended
    # last with ends, the GPU environments' resolutions (104 s of its wall, waiting on the
    # package registry).
    "parts": (
        "tests/areal",
        "tests/gym",
        "tests/audit",
        "tests/monitor",
        "tests/credit",
        "tests/cpu",
        "tests/curriculum",
        "tests/bench",
        "tests/app/test_config_load.py",
        "tests/app/test_harness.py",
        "tests/app/test_check_gpu.py",
        "tests/app/test_check_cluster.py",
        "tests/app/test_config.py",
        "tests/warehouse/test_export.py",
        "tests/trajectory/test_convert_unit.py",
        "tests/common/test_harness_imports.py",
        "tests/inference/test_environments.py",
    ),
}
SLOWEST = 20
# The processes side by side keep both cores busy, and torch's OpenMP threads spin while they
# wait: the actor's tests spent 1.9x the CPU seconds beside two busy processes with the policy
# unset than with PASSIVE (bench/openmp_wait.py). Every process of the run inherits it (the
# CPU harness gives AReaL's workers the same default: cua_rl/cpu/training.py).
QUIET_OPENMP = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
# The main process's priority (a nice value; 0 leaves it as it is). With the kernel's autogroup
# scheduling (/proc/sys/kernel/sched_autogroup_enabled) the cores are shared between sessions,
# and each process beside, each training's launcher and each test's vLLM server is a session of
# its own, so main's tests, in-process Python for the most part, got about a third of a core
# and main ended 160-240 s after the last other process, one core idle meanwhile (fresh clones,
# 2026-11-29). Lowering a nice value needs CAP_SYS_NICE: without it main keeps its priority and
# the run says so.
MAIN_NICE = int(os.environ.get("CUA_TEST_MAIN_NICE", "-5"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / ".cache" / "test-logs",
        help="where the processes beside write their output (beside-<group>.log), the JUnit "
        "reports and the trainings' costs",
    )
    ap.add_argument("pytest_args", nargs="*", help="passed to every pytest process")
    args = ap.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "pytest", "-ra"]
    groups = selections(BESIDE)
    reports = {group: args.log_dir / f"junit-{group}.xml" for group in groups}
    costs = {group: args.log_dir / f"costs-{group}.jsonl" for group in groups}
    for path in (*reports.values(), *costs.values()):
        path.unlink(missing_ok=True)

    def command(group: str) -> list[str]:
        # The caller's arguments come last, so that they override ours.
        return [*py, f"--junitxml={reports[group]}", *groups[group], *args.pytest_args]

    def env(group: str) -> dict[str, str]:
        return {**os.environ, "CUA_TEST_COSTS": str(costs[group]), **QUIET_OPENMP}

    start = time.monotonic()
    beside: dict[str, tuple[subprocess.Popen, Path]] = {}
    main_proc: subprocess.Popen | None = None
    restore_priority = None
    try:
        for group in BESIDE:
            log = args.log_dir / f"beside-{group}.log"
            print(f"[tests] {group} runs beside the rest; its output: {log}", flush=True)
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    command(group),
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env(group),
                )
            beside[group] = (proc, log)
        main_proc = subprocess.Popen(command("main"), cwd=ROOT, env=env("main"))
        restore_priority = prioritise(main_proc.pid, MAIN_NICE)
        procs = {"main": main_proc, **{group: proc for group, (proc, _) in beside.items()}}
        meters = {name: TreeCPU(proc.pid, every=2.0).start() for name, proc in procs.items()}
        ended: dict[str, float] = {}
        cpu: dict[str, float] = {}
        while len(ended) < len(procs):
            for name, proc in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic() - start
                    cpu[name] = meters[name].stop()
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
    finally:
        if restore_priority is not None:
            restore_priority()
    for group, (_, log) in beside.items():
        print(f"\n[tests] ===== output of the tests beside: {group} ({log}) =====", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    print_slowest(reports)
    print_costs(costs)
    took = time.monotonic() - start
    failed = main_rc != 0 or any(codes.values())

    def spent(name: str) -> str:
        return f"{ended[name]:.0f} s, {cpu[name]:.0f} CPU s"

    exits = ", ".join(f"{group} exit {rc} ({spent(group)})" for group, rc in codes.items())
    print(
        f"[tests] {'FAILED' if failed else 'passed'}: main exit {main_rc} ({spent('main')}), "
        f"{exits}, {took:.0f} s wall, {sum(cpu.values()):.0f} CPU s "
        f"({sum(cpu.values()) / took:.2f} cores busy on average)"
    )
    return main_rc or next((rc for rc in codes.values() if rc), 0)


def selections(beside: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Each process's pytest arguments: a group's folders, files and tests, less what another
    group names inside them; the main process everything else."""
    every = [path for paths in beside.values() for path in paths]

    def left_out(path: str) -> str:
        return f"--deselect={path}" if "::" in path else f"--ignore={path}"

    def within(path: str, folder_or_file: str) -> bool:
        file = path.split("::")[0]
        return file == folder_or_file or file.startswith(folder_or_file.rstrip("/") + "/")

    out = {"main": [left_out(p) for p in every]}
    for group, paths in beside.items():
        # Another group's tests, files or folders inside this group's files and folders.
        inside = [q for q in every if q not in paths and any(within(q, p) for p in paths)]
        out[group] = [*paths, *(left_out(q) for q in inside)]
    return out


def slowest(reports: dict[str, Path], n: int = SLOWEST) -> list[tuple[float, str, str]]:
    """(seconds, test, group) of the ``n`` slowest tests of every process (set-up, call and
    tear-down together: a shared training's time falls on the first test that asks for it)."""
    found = []
    for group, path in reports.items():
        if not path.exists():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            found.append((float(case.get("time") or 0), name, group))
    return sorted(found, reverse=True)[:n]


def print_slowest(reports: dict[str, Path]) -> None:
    rows = slowest(reports)
    if not rows:
        return
    print(f"\n[tests] the {len(rows)} slowest tests (set-up and tear-down included):", flush=True)
    for seconds, name, group in rows:
        print(f"[tests] {seconds:7.1f} s  {name}  ({group})", flush=True)


def costs_of(costs: dict[str, Path]) -> list[tuple[str, dict]]:
    out = []
    for group, path in costs.items():
        if path.exists():
            out += [(group, json.loads(line)) for line in path.read_text().splitlines() if line]
    return out


def print_costs(costs: dict[str, Path]) -> None:
    """Every whole training and shared server of the run with its wall time (the budget: the
    table in tests/README.md)."""
    rows = costs_of(costs)
    if not rows:
        return
    trainings = [(g, r) for g, r in rows if r["kind"] == "training"]
    servers = [(g, r) for g, r in rows if r["kind"] == "server"]

    def total(rows: list, key: str) -> float:
        return sum(r.get(key, 0.0) for _, r in rows)

    print(
        f"\n[tests] whole trainings: {len(trainings)}, {total(trainings, 'seconds'):.0f} s, "
        f"{total(trainings, 'cpu_seconds'):.0f} CPU s in all; shared vLLM servers: {len(servers)}, "
        f"started in {total(servers, 'seconds'):.0f} s, {total(servers, 'cpu_seconds'):.0f} CPU s "
        "(budget: tests/README.md)",
        flush=True,
    )
    for group, r in sorted(
        trainings + servers, key=lambda gr: -gr[1].get("cpu_seconds", gr[1]["seconds"])
    ):
        line = f"{r['seconds']:7.1f} s {r.get('cpu_seconds', float('nan')):7.1f} CPU s"
        print(f"[tests] {line}  {r['kind']:8}  {r['name']}  ({group})", flush=True)
    tests = sorted(
        ((g, r) for g, r in rows if r["kind"] == "test"), key=lambda gr: -gr[1]["cpu_seconds"]
    )
    if tests:
        print(
            f"\n[tests] the {min(SLOWEST, len(tests))} costliest of {len(tests)} tests in CPU "
            f"seconds ({total(tests, 'cpu_seconds'):.0f} CPU s in all; a shared training's or "
            "server's on the first test that asks for it):",
            flush=True,
        )
        for group, r in tests[:SLOWEST]:
            line = f"{r['cpu_seconds']:7.1f} CPU s {r['seconds']:7.1f} s"
            print(f"[tests] {line}  {r['name']}  ({group})", flush=True)


def prioritise(pid: int, nice: int, autogroup: Path = Path("/proc/self/autogroup")):
    """Give process ``pid`` the nice value ``nice``, and the scheduling group of this process's
    session (``autogroup``: main's too, and make's, whose processes wait) the same, which is what
    counts where the kernel groups by session. Says what it did, or why not; returns what puts
    the group's value back (the session may be a developer's shell, which outlives the run)."""

    def nothing() -> None:
        pass

    if nice == 0:
        return nothing
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError as exc:
        print(
            f"[tests] the main process keeps its priority (CUA_TEST_MAIN_NICE={nice}: {exc}); "
            "it may end minutes after the others",
            flush=True,
        )
        return nothing
    print(f"[tests] the main process runs at nice {nice} (CUA_TEST_MAIN_NICE)", flush=True)
    before = _group_nice(autogroup, nice)
    if before is None:
        return nothing

    def restore() -> None:
        try:
            autogroup.write_text(f"{before}\n")
        except OSError as exc:  # the tests' outcome stands whatever happens here
            print(f"[tests] the session's scheduling group stays at nice {nice} ({exc}); "
                  f"`echo {before} > /proc/<pid>/autogroup` puts it back", flush=True)  # fmt: skip

    return restore


def _group_nice(autogroup: Path, nice: int) -> int | None:
    """Set the session's scheduling group to ``nice`` and return its value before, or ``None``
    where there is no group to set: a kernel without autogroup has no file, and some sandboxes
    serve an empty one (CI's), so its text is parsed, never assumed."""
    if not autogroup.exists():
        return None
    try:
        found = re.fullmatch(r"\S+ nice (-?\d+)\s*", autogroup.read_text())
        if found is None:
            print(f"[tests] the session's scheduling group keeps its value ({autogroup} does "
                  "not read '/autogroup-N nice V')", flush=True)  # fmt: skip
            return None
        autogroup.write_text(f"{nice}\n")
    except OSError as exc:
        print(f"[tests] the session's scheduling group keeps its value ({exc})", flush=True)
        return None
    return int(found.group(1))


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
