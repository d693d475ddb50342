"""``make demo``: the main job on the embedded default, on one machine with no GPU and no services.

Starts, as child processes in their own process groups: the monitor on a SQLite file, the local
gym and the local agent; builds the tiny Qwen2-VL (cached, no download); then runs
``python -m examples.cua_agent.train --config configs/local.yaml`` with the URLs and the model
filled in. The trainer's output (AReaL's workers included) goes to ``logs/train.log``; the
terminal shows the dashboard's URL, a live progress line and one summary line per step
(``progress.py``, read from the monitor's database). Whatever happens (failure, Ctrl-C) it stops
what it started, then prints where the database and the logs are, what the monitor recorded,
and the command that serves the database again for browsing.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from cua_rl.app.progress import DemoProgress
from cua_rl.monitor.server.migrations import write_back
from cua_rl.monitor.server.read import MonitorReader
from cua_rl.serving import bind_free_port
from cua_rl.testing.cache import FAMILY_KINDS

ROOT = Path(__file__).resolve().parents[2]
# The agent function `--agent-mode function` trains unless an override names another.
EXAMPLE_AGENT = "examples.cua_agent.openai_agent:run"


class Stopped(Exception):
    """The caller asked the run to end (``main(stop=...)``): train.py is stopped as on Ctrl-C."""


class Child:
    """A service process whose output goes to a log file; stopped by process group."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            time.sleep(0.2)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.name} did not become ready (log {self.log_path}):\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        self._log.close()


def free_port() -> int:
    sock = bind_free_port()
    port = sock.getsockname()[1]
    sock.close()
    return port


def wait_http(url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def summary(db_path: Path) -> list[str]:
    if not db_path.exists():
        return ["monitor database was not created"]
    db = MonitorReader(db_path)
    try:
        out = []
        for t in db.trainings():
            err = t["error_message"]
            out.append(
                f"training {t['run_name']}: {t['status']}" + (f" ({err[:200]})" if err else "")
            )
        tables = ("step", "baseline", "eval", "rollout", "turn", "action", "screenshot")
        counts = [
            f"{n} {table}{'s' if n != 1 else ''}" for table, n in db.table_counts(tables).items()
        ]
        out.append("  recorded: " + ", ".join(counts))
        return out
    finally:
        db.close()


def launcher_parser(prog: str, description: str, config: str, run_dir: str):
    """The arguments the demo and the learning launcher share: the config, the run's folder,
    train.py's own overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", default=config)
    parser.add_argument("--run-dir", default="", help=f"default {run_dir}")
    parser.add_argument(
        "--agent-mode",
        choices=("service", "builtin", "function"),
        default="service",
        help="service: start the local agent service and give episodes to it; builtin: start "
        "none, the rollout workers run the agent loop themselves; function: start none, the "
        f"rollout workers call a Python agent (agent.function, by default {EXAMPLE_AGENT}, "
        "written with the openai SDK) (agent.mode)",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    return parser


def _example_agent(args) -> bool:
    """Whether ``--agent-mode function`` trains the example: no override names a function."""
    named = any(o.startswith("agent.function=") for o in args.overrides)
    return args.agent_mode == "function" and not named


def agent_function(args) -> str:
    """The agent function of ``--agent-mode function``: an ``agent.function=`` override's, else
    the example's."""
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("agent.function=")]
    return given[-1] if given else EXAMPLE_AGENT


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = launcher_parser(
        "python -m cua_rl.app.demo", __doc__, "configs/local.yaml", "runs/demo-<time>"
    )
    parser.add_argument(
        "--model",
        default="qwen2-vl-bpe",
        choices=("qwen2-vl-bpe", "qwen2-vl-byte", *FAMILY_KINDS),
        help="tiny model to build and train: Qwen2-VL with a byte-level BPE tokenizer (as "
        "production models have) or byte-only, or a production family (BPE, its own template)",
    )
    parser.add_argument(
        "--step-latency",
        type=float,
        default=0.5,
        help="seconds the local agent waits after each action, like a device settling: episodes "
        "then last long enough to meet weight updates, as in production",
    )
    parser.add_argument(
        "--box-startup", type=float, default=0.0, help="seconds the local gym takes to create a box"
    )
    parser.add_argument(
        "--gym-url",
        default="",
        help="a gym server already running (URL without /api/v1) to train against instead of "
        "starting the local one; it outlives the run, so its executions show what the run left",
    )
    parser.add_argument(
        "--gym-args",
        default="",
        help="extra options for the local gym (python -m cua_rl.sim gym --help), e.g. "
        "'--backend browser --gym-id miniwob --tasks click-test,click-button' for MiniWoB++ "
        "pages in chromium (configs/miniwob.yaml)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no live progress lines (a caller prints its own); the end still says where "
        "things are, and a failure shows the end of logs/train.log",
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="train under AReaL's Ray scheduler on a two-node Ray cluster started on this "
        "machine (loopback only; stopped at the end): scheduler.type=ray",
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="train under AReaL's Slurm scheduler on a single-node Slurm started on this "
        "machine (needs root and the slurm-wlm and munge packages): scheduler.type=slurm",
    )
    return parser.parse_args(argv)


def start_services(args, db_path: Path, log_dir: Path, children: list[Child]) -> dict[str, str]:
    """The monitor, the local gym and the local agent, each a child process; their URLs."""
    py = sys.executable
    mon_port = free_port()
    serve = ["-m", "cua_rl.monitor", "serve", "--db", str(db_path), "--port", str(mon_port)]
    children.append(Child("monitor", [py, *serve], log_dir))
    monitor_url = f"http://127.0.0.1:{mon_port}"
    wait_http(f"{monitor_url}/healthz", 60)
    print(f"[demo] monitor  {monitor_url} -> {_shown(db_path)}", flush=True)
    print(f"[demo] dashboard: open {monitor_url}/ to watch the training live", flush=True)

    if args.gym_url:
        gym_url = args.gym_url.rstrip("/")
    else:
        gym_cmd = [py, "-m", "cua_rl.sim", "gym", "--port", "0", *shlex.split(args.gym_args)]
        gym = Child("gym", [*gym_cmd, "--create-latency", str(args.box_startup)], log_dir)
        children.append(gym)
        # The ready line names the genv base (.../api/v1/sim); the config wants the server URL.
        gym_url = gym.wait_for_line("ready ", 60).split("/api/v1/")[0]
    print(f"[demo] gym      {gym_url}", flush=True)

    if args.agent_mode == "builtin":
        print("[demo] agent    builtin: run by the rollout workers", flush=True)
        return {"monitor": monitor_url, "gym": gym_url, "agent": ""}
    if args.agent_mode == "function":
        print(f"[demo] agent    {agent_function(args)}: called by the rollout workers", flush=True)
        return {"monitor": monitor_url, "gym": gym_url, "agent": ""}
    agent_cmd = [py, "-m", "cua_rl.sim", "agent", "--port", "0"]
    agent = Child("agent", [*agent_cmd, "--step-latency", str(args.step_latency)], log_dir)
    children.append(agent)
    agent_url = agent.wait_for_line("ready ", 60)
    print(f"[demo] agent    {agent_url}", flush=True)
    return {"monitor": monitor_url, "gym": gym_url, "agent": agent_url}


# Terminal colour and style sequences (CSI ... m): AReaL's logger writes them whatever the
# stream, and a log file read with less, grep or an editor shows them as noise.
ANSI_STYLE = re.compile(rb"\x1b\[[0-9;]*m")


def copy_plain(source, log_file) -> None:
    """Each line of ``source`` into ``log_file`` without colour sequences, as it comes."""
    for line in iter(source.readline, b""):
        log_file.write(ANSI_STYLE.sub(b"", line))
        log_file.flush()


def run_trainer(
    cmd: list[str],
    train_log: Path,
    progress: DemoProgress,
    env: dict,
    stop: threading.Event | None = None,
) -> int:
    """train.py in its own session, its output in ``train_log`` (colour codes left out),
    progress ticking meanwhile; stopped as on Ctrl-C once ``stop`` is set."""
    with open(train_log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        copier = threading.Thread(
            target=copy_plain, args=(proc.stdout, log_file), name="train-log", daemon=True
        )
        copier.start()
        try:
            while proc.poll() is None:
                if stop is not None and stop.is_set():
                    raise Stopped()
                progress.tick()
                time.sleep(1.0)
            rc = proc.wait()
            time.sleep(0.5)  # the monitor commits the last records just before the exit
            progress.tick()
            return rc
        except (KeyboardInterrupt, Stopped):
            # train.py stops on SIGTERM as on Ctrl-C (AReaL stops its workers and vLLM, the
            # training is recorded cancelled); SIGINT could be ignored by inheritance.
            proc.send_signal(signal.SIGTERM)
            progress.close()  # the progress line off the terminal before what follows
            try:
                # 143 is a clean stop on SIGTERM (128 + 15); anything else is worth a look.
                print(f"[demo] the trainer stopped: exit {proc.wait(120)}", flush=True)
            except subprocess.TimeoutExpired:
                print("[demo] the trainer did not stop within 120 s: killing it", flush=True)
            raise
        finally:
            progress.close()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            # The pipe ends when the trainer's process group has closed it; a worker it left
            # behind would hold it open, so the copy is waited for a while, not for ever.
            copier.join(30)


def train(
    args,
    run_dir: Path,
    log_dir: Path,
    db_path: Path,
    children: list[Child],
    clusters: list,
    stop: threading.Event | None = None,
) -> int:
    from cua_rl.testing.cache import ensure_model

    print(f"[demo] model    tiny {args.model}: ", end="", flush=True)
    started = time.time()
    model_dir = ensure_model(args.model)
    # Built by this call when its completion mark is newer than the call (the cache's own key).
    if (model_dir / ".complete").stat().st_mtime >= started:
        print(
            f"built in {time.time() - started:.0f}s into {_shown(model_dir)} (later runs reuse it)"
        )
    else:
        print(f"cached in {_shown(model_dir)}", flush=True)
    urls = start_services(args, db_path, log_dir, children)
    train_env = dict(os.environ)
    clusters.extend(c for c in _start_scheduler(args, run_dir, log_dir, train_env) if c)
    cmd = [
        sys.executable,
        "-m",
        "examples.cua_agent.train",
        "--config",
        args.config,
        f"actor.path={model_dir}",
        f"gym.base_url={urls['gym']}",
        f"agent.mode={args.agent_mode}",
        *([f"agent.base_url={urls['agent']}"] if urls["agent"] else []),
        # The example, unless an override names the function (a key may be given once).
        *([f"agent.function={EXAMPLE_AGENT}"] if _example_agent(args) else []),
        # The builtin loop settles after each action as the local agent service does.
        f"agent.builtin.step_latency_s={args.step_latency}",
        f"monitor.base_url={urls['monitor']}",
        f"cluster.fileroot={run_dir / 'areal'}",
        f"cluster.name_resolve.nfs_record_root={run_dir / 'name_resolve'}",
        *args.overrides,
    ]
    train_log = log_dir / "train.log"
    print(f"[demo] training (output in {_shown(train_log)}): {shown_command(cmd)}", flush=True)
    # The trainer's and AReaL's workers' output stays in the log; the terminal shows
    # progress read from the monitor's database.
    progress = DemoProgress(
        db_path,
        io.StringIO() if args.quiet else None,
        prefix="[demo] ",
        log_path=log_dir / "progress.log",
    )
    rc = run_trainer(cmd, train_log, progress, train_env, stop)
    if rc != 0:
        tail = train_log.read_text(errors="replace").splitlines()[-40:]
        print(f"[demo] the trainer exited {rc}; the end of {_shown(train_log)}:", flush=True)
        print("\n".join(tail), flush=True)
    return rc


def trainer_reports(train_log: Path) -> list[str]:
    """The rollout workers' drain reports in the trainer's log (cua_rl.rollout.drain), and
    train.py's notes (``note: ...``, such as fewer steps than total_train_steps asked)."""
    if not train_log.exists():
        return []
    text = train_log.read_text(errors="replace")
    mark = "cua_rl.rollout.drain: "
    lines = text.splitlines()
    notes = [line for line in lines if line.startswith("note: ")]
    return notes + ["drain: " + line.split(mark, 1)[1] for line in lines if mark in line]


def print_end(rc: int, seconds: float, run_dir: Path, log_dir: Path, db_path: Path) -> None:
    # How the episodes in flight at the end were closed, and what was left open (by id).
    for line in trainer_reports(log_dir / "train.log"):
        print(f"[demo] {line}", flush=True)
    print(f"[demo] finished with exit code {rc} in {seconds:.0f}s", flush=True)
    print(f"[demo] monitor database: {_shown(db_path)}", flush=True)
    print(
        f"[demo] logs: {_shown(log_dir)} "
        f"({', '.join(sorted(p.name for p in log_dir.glob('*.log')))}; "
        f"AReaL's workers: {_shown(run_dir / 'areal' / 'logs')})",
        flush=True,
    )
    for line in summary(db_path):
        print(f"[demo] {line}", flush=True)
    if db_path.exists():
        # The monitor wrote its WAL back when it stopped; the summary's read-only connection
        # left an empty one: the run's database is one file again, whole when copied alone.
        try:
            write_back(db_path)
        except sqlite3.Error as exc:
            print(f"[demo] {_shown(db_path)}-wal not written back ({exc}): copy it too", flush=True)
        serve = [sys.executable, "-m", "cua_rl.monitor", "serve", "--db", str(db_path)]
        print("[demo] browse this run again at http://127.0.0.1:8765/ with:", flush=True)
        print(f"[demo]   {shown_command([*serve, '--port', '8765'])}", flush=True)


def main(argv: list[str] | None = None, stop: threading.Event | None = None) -> int:
    """The launcher; a caller that sets ``stop`` (``make learn --stop-at-target``) ends the
    run as Ctrl-C would, and gets exit code 0."""
    args = parse_args(argv)

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Ctrl-C and a SIGTERM to the launcher both stop everything it started, in order.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (ROOT / (args.run_dir or f"runs/demo-{stamp}")).resolve()
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    db_path = run_dir / "monitor.db"
    children: list[Child] = []
    clusters: list = []
    rc = 1
    t0 = time.monotonic()
    try:
        rc = train(args, run_dir, log_dir, db_path, children, clusters, stop)
    except Stopped:
        print("[demo] stopped as asked: the training is recorded cancelled", flush=True)
        rc = 0
    except KeyboardInterrupt:
        print("\n[demo] interrupted", flush=True)
        rc = 130
    except Exception as exc:
        print(f"[demo] failed: {exc}", flush=True)
        rc = 1
    finally:
        for cluster in reversed(clusters):
            _stop_cluster(cluster, log_dir)
        for child in reversed(children):
            child.stop()
        print_end(rc, time.monotonic() - t0, run_dir, log_dir, db_path)
    return rc


def _start_scheduler(args, run_dir: Path, log_dir: Path, train_env: dict):
    """--ray / --slurm: the local cluster the trainer's scheduler runs on; adds the scheduler's
    override to ``args.overrides`` and what the trainer needs to ``train_env``."""
    cluster = slurm = None
    py = sys.executable
    if args.ray:
        from cua_rl.cpu.ray_cluster import LocalRayCluster

        cluster = LocalRayCluster(log_dir, nodes=2).start()
        for failed in cluster.failed_starts:
            print(
                f"[demo] ray      a start failed and the cluster started again: {failed}",
                flush=True,
            )
        train_env["RAY_ADDRESS"] = cluster.address
        args.overrides = ["scheduler.type=ray", *args.overrides]
        print(
            f"[demo] ray      {cluster.address}: 2 nodes on loopback, started in "
            f"{cluster.started_in_s:.1f}s (session files {cluster.temp_dir})",
            flush=True,
        )

    if args.slurm:
        from cua_rl.cpu.slurm_cluster import LocalSlurm

        slurm = LocalSlurm(run_dir / "slurm").start()
        # Slurm tasks run `python -m ...` from PATH, in the trainer's environment.
        path = f"{Path(py).parent}{os.pathsep}{train_env.get('PATH', '')}"
        train_env.update(slurm.env(), PATH=path)
        # AReaL's Slurm scheduler requires its shared folders to exist beforehand.
        (run_dir / "name_resolve").mkdir(parents=True, exist_ok=True)
        (run_dir / "areal").mkdir(parents=True, exist_ok=True)
        args.overrides = ["scheduler.type=slurm", *args.overrides]
        print(f"[demo] slurm    single node on loopback ({_shown(slurm.conf)})", flush=True)
    return cluster, slurm


def _record_placement(cluster, log_dir: Path) -> None:
    """Which node each of AReaL's workers ran on, printed and kept in logs/ray-actors.json."""
    import json

    try:
        actors = cluster.placement()
    except Exception as exc:
        print(f"[demo] ray: placement not read ({exc})", flush=True)
        return
    (log_dir / "ray-actors.json").write_text(json.dumps(actors, indent=1))
    where = ", ".join(f"{a['name']} on node {a['node_id'][:8]}" for a in actors)
    print(f"[demo] ray      workers: {where or 'none'}", flush=True)


def _stop_cluster(cluster, log_dir: Path) -> None:
    """Stop a cluster ``_start_scheduler`` started; a Ray cluster first says where workers ran."""
    from cua_rl.cpu.ray_cluster import LocalRayCluster

    if isinstance(cluster, LocalRayCluster):
        _record_placement(cluster, log_dir)
        cluster.stop()
        print(f"[demo] ray      cluster stopped in {cluster.stopped_in_s:.1f}s", flush=True)
    else:
        cluster.stop()


def shown_command(argv: list[str]) -> str:
    """A command as typed from the repository root, where the demo runs it: the interpreter
    named (``.venv/bin/python``: a bare ``python`` outside the environment lacks its packages)
    and paths inside the repository relative to it."""
    inside = f"{ROOT}{os.sep}"
    return shlex.join(arg.replace(inside, "") for arg in argv)


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the repository when it is inside it."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
