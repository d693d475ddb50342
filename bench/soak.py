"""A soak under faults: the local stack trains asynchronously for a while, faults on a schedule.

Starts what ``make demo`` starts (``cua_rl/app/demo.py``: the monitor on a SQLite file, the local
gym, the local agent, then ``train.py`` with ``configs/local.yaml``, which brings up vLLM CPU and
AReaL's workers), every service on 127.0.0.1 on a fixed port so it can be restarted in place,
and the rollout gateway's model calls through a loopback proxy (``cua_rl/testing/fault_proxy``,
``gateway.model_server_url``) in front of vLLM. The training is long (``total_train_steps``
large, no eval) and stopped on time: SIGTERM to the trainer at the deadline, then the end state
is measured as found. After warm-up (the first step committed) a schedule injects, evenly spaced
and in turn:

- ``gym_5xx``: the gym answers half of its creates 500 for a while (its fault endpoint);
- ``slow_create``: every create waits several seconds before it is served;
- ``agent_kill``: the agent service SIGKILLed, restarted on its port a few seconds later;
- ``monitor_kill``: the monitor SIGKILLed, restarted on its port and database later (the
  trainer's monitor client spools meanwhile and replays);
- ``model_drop``: one model answer cut mid-way (the gateway re-sends it: nothing should be lost);
- ``model_outage``: every model answer cut for a while; the gateway holds the calls through it
  (past ``gateway.model_outage_s`` they fail and their episodes are rejected with a reason).

Printed (how each figure is computed: docs/soak.md): episodes started, finished,
rejected by reason, cancelled, still open; which fault each rejection falls under (a rejection
outside every fault's window is unexplained); gym executions alive at the end (asked of the
gym); monitor records open at the end, lost (the rollout worker's own rejections absent from
the database or recorded otherwise; gym executions with no environment record) and duplicated;
RSS and open file descriptors per role after warm-up and at the end; bytes of screenshots and
of the database per episode; one verdict line.

    python bench/soak.py [--minutes 20] [--concurrency 4] [--run-dir DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from soak_accounting import (  # noqa: E402 - beside this file
    AFTERMATH_S,
    Accounting,
    Episode,
    Fault,
    account,
    fault_schedule,
    lost_records,
    ratio,
    role_of,
    seconds_after,
    utc_now,
    verdict,
    worker_view,
)

from cua_rl.app.demo import Child, free_port, wait_http  # noqa: E402
from cua_rl.monitor.server.read import MonitorReader  # noqa: E402
from cua_rl.testing.fault_proxy import FaultProxy  # noqa: E402
from cua_rl.testing.procs import vllm_port  # noqa: E402

DUPS = (
    "duplicate_actions",
    "duplicate_observations",
    "duplicate_environments",
    "duplicate_validations",
)
# What the trainer's end leaves time for after the SIGTERM before it is killed.
STOP_GRACE_S = 180.0


# ---------------------------------------------------------------------------- the stack


class Stack:
    """The services on fixed loopback ports, restartable in place, and the trainer."""

    def __init__(self, args, run_dir: Path):
        self.args, self.run_dir = args, run_dir
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.db = run_dir / "monitor.db"
        self.ports = {name: free_port() for name in ("monitor", "gym", "agent")}
        self.children: dict[str, Child] = {}
        self.restarts: Counter = Counter()
        self.proxy = FaultProxy().start()
        self.trainer: subprocess.Popen | None = None
        self.t0, self.t0_utc = time.monotonic(), utc_now()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        py, port = sys.executable, str(self.ports[name])
        argv = {
            "monitor": [py, "-m", "cua_rl.monitor", "serve", "--db", str(self.db), "--port", port],
            "gym": [py, "-m", "cua_rl.sim", "gym", "--port", port],
            "agent": [
                py, "-m", "cua_rl.sim", "agent", "--port", port,
                "--step-latency", str(self.args.step_latency),
            ],
        }[name]  # fmt: skip
        n = self.restarts[name]
        self.children[name] = Child(name if not n else f"{name}-{n}", argv, self.log_dir)
        health = {"monitor": "/healthz", "gym": "/healthz", "agent": "/"}[name]
        wait_http(self.url(name) + health, 60)

    def kill(self, name: str) -> None:
        child = self.children.pop(name)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(10)
        child.stop()
        self.restarts[name] += 1

    def gym(self, method: str, path: str, **kw):
        import httpx

        return httpx.request(method, self.url("gym") + path, timeout=10, **kw)

    def start_trainer(self, model_dir: Path) -> None:
        a, rd = self.args, self.run_dir
        cmd = [
            sys.executable, "-m", "examples.cua_agent.train", "--config", "configs/local.yaml",
            f"actor.path={model_dir}", f"gym.base_url={self.url('gym')}",
            f"agent.base_url={self.url('agent')}", f"monitor.base_url={self.url('monitor')}",
            f"cluster.fileroot={rd / 'areal'}",
            f"cluster.name_resolve.nfs_record_root={rd / 'name_resolve'}",
            "total_train_epochs=100000", "total_train_steps=100000",
            f"rollout.max_concurrent_rollouts={a.concurrency}",
            "rollout.max_head_offpolicyness=1",
            "evaluator.eval_before_train=false", "evaluator.freq_steps=null",
            "endpoint.mode=gateway", f"+gateway.model_server_url={self.proxy.url}",
            *a.overrides,
        ]  # fmt: skip
        self._train_log = open(self.log_dir / "train.log", "wb")  # noqa: SIM115 - closed in stop
        self.trainer = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._train_log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def find_vllm_port(self) -> int | None:
        return vllm_port(self.trainer.pid) if self.trainer is not None else None

    def processes(self) -> list[tuple[int, str, str]]:
        """(pid, role, cmdline) of every process the soak started, alive now."""
        import psutil

        out = []
        for name, child in self.children.items():
            out += self._tree(psutil, child.proc.pid, name)
        if self.trainer is not None and self.trainer.poll() is None:
            out += self._tree(psutil, self.trainer.pid, None)
        return out

    @staticmethod
    def _tree(psutil, pid: int, role: str | None) -> list[tuple[int, str, str]]:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            try:
                chain = [" ".join(p.cmdline())] + [" ".join(a.cmdline()) for a in p.parents()]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out.append((p.pid, role or role_of(chain) or "trainer", chain[0]))
        return out

    def sample(self) -> dict[str, tuple]:
        """role -> (processes, RSS MiB, open fds, of them sockets, anonymous MiB, file-backed
        MiB), summed over the role. The split tells a heap that grows (anonymous: malloc, torch)
        from library and model pages touched for the first time (file-backed, shared)."""
        import psutil

        out: dict[str, list] = {}
        for pid, role, _ in self.processes():
            try:
                p = psutil.Process(pid)
                rss, fds = p.memory_info().rss, p.num_fds()
                socks = len(p.net_connections(kind="all"))
                anon, file = rss_split(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                continue
            cur = out.setdefault(role, [0, 0.0, 0, 0, 0.0, 0.0])
            cur[0] += 1
            cur[1] += rss / 2**20
            cur[2] += fds
            cur[3] += socks
            cur[4] += anon / 2**20
            cur[5] += file / 2**20
        return {k: tuple(v) for k, v in out.items()}

    def stop_trainer(self) -> int:
        if self.trainer is None:
            return -1
        if self.trainer.poll() is None:
            self.trainer.send_signal(signal.SIGTERM)
            try:
                self.trainer.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                import os

                os.killpg(self.trainer.pid, signal.SIGKILL)
                self.trainer.wait(10)
        self._train_log.close()
        return self.trainer.returncode

    def stop(self) -> None:
        if self.trainer is not None and self.trainer.poll() is None:
            self.stop_trainer()
        for child in reversed(list(self.children.values())):
            child.stop()
        self.proxy.stop()


# ---------------------------------------------------------------------------- the run


def inject(stack: Stack, fault: Fault, log) -> None:
    """Start ``fault``; it is undone by ``recover`` after ``fault.seconds``."""
    k = fault.kind
    if k == "gym_5xx":
        stack.gym("PUT", "/api/v1/_sim/faults", json={"create": {"fail_rate": 0.5}})
    elif k == "slow_create":
        stack.gym("PUT", "/api/v1/_sim/faults", json={"create": {"latency_s": 8.0}})
    elif k in ("agent_kill", "monitor_kill"):
        stack.kill(k.removesuffix("_kill"))
    elif k == "model_drop":
        stack.proxy.drop_next(1)
    elif k == "model_outage":
        stack.proxy.drop_for(fault.seconds)
    log(f"fault {k} at {fault.at_s:.0f}s for {fault.seconds:.0f}s")


def recover(stack: Stack, fault: Fault, log) -> None:
    k = fault.kind
    if k in ("gym_5xx", "slow_create"):
        stack.gym("PUT", "/api/v1/_sim/faults", json={"create": {}})
    elif k in ("agent_kill", "monitor_kill"):
        stack.start(k.removesuffix("_kill"))
        log(f"{k.removesuffix('_kill')} restarted")


SAMPLE_EVERY_S = 30.0  # the role table's figures over time, after warm-up (rss.csv)
SETTLE_S = 120.0  # the role table's "warm" column: this long after the first step


def record_sample(path: Path, at_s: float, sample: dict) -> None:
    """One line per role: seconds since the start, processes, RSS MiB, fds, sockets, RSS's
    anonymous and file-backed MiB. Whether a role's memory grows steadily or levels off is read
    from these, not from two points."""
    new = not path.exists()
    with open(path, "a", encoding="utf-8") as f:
        if new:
            f.write("t_s,role,procs,rss_mib,fds,sockets,anon_mib,file_mib\n")
        for role, (procs, rss, fds, socks, anon, file) in sorted(sample.items()):
            f.write(f"{at_s:.0f},{role},{procs},{rss:.1f},{fds},{socks},{anon:.1f},{file:.1f}\n")


def rss_split(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed and shared) resident bytes of ``pid``, from /proc/PID/status."""
    kib = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem"):
            kib[key] = int(value.split()[0])
    return kib["RssAnon"] * 1024, (kib["RssFile"] + kib["RssShmem"]) * 1024


def run(args, stack: Stack, log) -> dict:
    """Warm up, inject the schedule until the deadline, stop the trainer; what was sampled."""
    from cua_rl.testing.cache import ensure_model

    model_dir = ensure_model(args.model)
    for name in ("monitor", "gym", "agent"):
        stack.start(name)
    log(f"monitor {stack.url('monitor')}, gym {stack.url('gym')}, agent {stack.url('agent')}")
    stack.t0, stack.t0_utc = time.monotonic(), utc_now()
    deadline = args.minutes * 60.0
    stack.start_trainer(model_dir)
    out: dict = {
        "faults": [],
        "warm_at": None,
        "warm": {},
        "settled": False,
        "end": {},
        "early_exit": False,
    }
    pending: list[Fault] = []
    undo: list[Fault] = []
    next_sample = 0.0
    while (now := time.monotonic() - stack.t0) < deadline:
        if stack.trainer.poll() is not None:
            log(f"the trainer exited {stack.trainer.returncode} before the deadline")
            out["early_exit"] = True
            break
        if stack.proxy.upstream is None and (port := stack.find_vllm_port()):
            stack.proxy.set_upstream("127.0.0.1", port)
            log(f"model proxy {stack.proxy.url} -> vLLM on port {port}")
        if out["warm_at"] is None and steps_done(stack.db) >= 1:
            out["warm_at"] = now
            out["warm"] = stack.sample()
            pending = fault_schedule(now + 5.0, deadline - 30.0)
            log(f"warm after {now:.0f}s: {len(pending)} faults scheduled")
        while pending and pending[0].at_s <= now:
            f = pending.pop(0)
            inject(stack, f, log)
            out["faults"].append(f)
            undo.append(f)
        for f in [f for f in undo if f.end_s <= now]:
            recover(stack, f, log)
            undo.remove(f)
        if out["warm_at"] is not None and now >= next_sample:
            sample = stack.sample()
            record_sample(stack.run_dir / "rss.csv", now, sample)
            next_sample = now + SAMPLE_EVERY_S
            if not out["settled"] and now >= out["warm_at"] + SETTLE_S:
                # The role table's baseline: the actor's optimizer state and every allocator
                # fill during the first steps, so the first step's figures are not steady.
                out["warm"], out["settled"] = sample, True
        time.sleep(1.0)
    for f in undo:
        recover(stack, f, log)
    out["end"] = stack.sample()
    out["deadline_s"] = time.monotonic() - stack.t0
    log("deadline: SIGTERM to the trainer")
    out["rc"] = stack.stop_trainer()
    out["stop_s"] = time.monotonic() - stack.t0 - out["deadline_s"]
    time.sleep(5.0)  # the monitor's last commits and replays
    health = stack.gym("GET", "/healthz").json()
    out["gym_live"] = health["live"]
    out["gym_counters"] = health["counters"]
    listing = stack.gym("GET", "/api/v1/sim/executions").json()["executions"]
    out["gym_alive"] = [e["execution_id"] for e in listing]
    return out


def steps_done(db: Path) -> int:
    if not db.exists():
        return 0
    reader = MonitorReader(db)
    try:
        t = reader.latest_training()
        return len(reader.finished_steps(t["id"])) if t else 0
    except Exception:
        return 0
    finally:
        reader.close()


# ---------------------------------------------------------------------------- reading back


def read_back(stack: Stack, faults: list[Fault]) -> dict:
    reader = MonitorReader(stack.db)
    try:
        t = reader.latest_training()
        rows = reader.training_rollout_outcomes(t["id"]) if t else []
        integrity = reader.record_integrity()
        pauses = reader.pause_table(t["id"]) if t else []
        shots = reader.screenshot_totals()
        steps = len(reader.finished_steps(t["id"])) if t else 0
        status = t["status"] if t else "none"
        error = (t["error_message"] or "") if t else ""
    finally:
        reader.close()
    episodes = [
        Episode(r["rollout_id"], r["status"], r["status_message"] or "", end)
        for r in rows
        for end in [seconds_after(r["end_time"], stack.t0_utc)]
    ]
    lines = [
        line
        for path in (stack.run_dir / "areal" / "logs").rglob("rollout.log")
        for line in path.read_text(errors="replace").splitlines()
    ]
    worker, surplus = worker_view(lines)
    recorded = {e.rollout_id: (e.status, e.reason) for e in episodes}
    db_bytes = sum(p.stat().st_size for p in stack.db.parent.glob(stack.db.name + "*"))
    return {
        "acc": account(episodes, faults),
        "lost": lost_records(worker, recorded),
        "surplus": len(surplus),
        "integrity": integrity,
        "shots": shots,
        "db_bytes": db_bytes,
        "steps": steps,
        "status": status,
        "error": error,
        "pauses": pauses,
    }


# ---------------------------------------------------------------------------- report


def report(out: dict, back: dict, stack: Stack) -> list[str]:
    acc: Accounting = back["acc"]
    faults: list[Fault] = out["faults"]
    integ = back["integrity"]
    lines = [
        f"training: {back['status']}, {back['steps']} steps committed; exit {out['rc']}, "
        f"{out['stop_s']:.0f}s from SIGTERM to exit (warm after {out['warm_at'] or 0:.0f}s)"
        + (f"; error: {back['error'][:300]}" if back["error"] else ""),
        f"episodes: started {acc.started}, finished {acc.finished}, rejected "
        f"{sum(acc.rejected.values())}, cancelled {acc.cancelled}, open {acc.open} "
        f"(+{back['surplus']} surplus, not recorded by design)",
    ]
    for reason, n in acc.rejected.most_common():
        lines.append(f"  rejected {reason}: {n}")
    lines.append(
        f"faults injected: {len(faults)} (rejections within a fault or {AFTERMATH_S:.0f}s after)"
    )
    for i, f in enumerate(faults):
        got = acc.by_fault.get(i, Counter())
        what = ", ".join(f"{r} x{n}" for r, n in got.most_common()) or "no rejection"
        lines.append(f"  {f.at_s:6.0f}s {f.kind:<13} {f.seconds:4.0f}s: {what}")
    lines.append(
        f"  proxy: {stack.proxy.dropped} model answers cut; restarts: "
        + ", ".join(f"{k} {n}" for k, n in sorted(stack.restarts.items()))
    )
    for ep in acc.unexplained:
        lines.append(f"  UNEXPLAINED {ep.rollout_id} {ep.reason or '(no reason)'} at {ep.end_s}s")
    counters = out["gym_counters"]
    # A gym pause ends with its probe's create (terminated at once, no episode's record).
    probes = sum(1 for p in back["pauses"] if p["service"] == "gym" and p["end_time"])
    box_gap = counters["created"] - integ["boxes"] - back["surplus"] - probes
    lines += [
        f"gym: {out['gym_live']} executions alive at the end {out['gym_alive'][:8]}; "
        f"created {counters['created']}, terminated {counters['terminated']}, expired "
        f"{counters['expired']}, faults {counters['faults']}",
        f"monitor: open at the end: {acc.open} rollouts, {integ['open_environments']} "
        f"environments; lost: {len(back['lost'])} rejections, {max(box_gap, 0)} gym executions "
        f"with no environment record (created - recorded boxes - surplus - probes = {box_gap}); "
        "duplicated: " + ", ".join(f"{integ[k]} {k.removeprefix('duplicate_')}" for k in DUPS),
    ]
    lines += [f"  LOST {line}" for line in back["lost"]]
    for service in sorted({p["service"] for p in back["pauses"]}):
        mine = [p for p in back["pauses"] if p["service"] == service]
        lines.append(
            f"pauses {service}: {len(mine)}, {sum(1 for p in mine if not p['end_time'])} open, "
            f"{sum(p['duration_s'] or 0 for p in mine):.0f}s in all, "
            f"{sum(p['probes'] or 0 for p in mine)} failed probes"
        )
    settled = f"{SETTLE_S:.0f}s after" if out["settled"] else "at (the run ended before it settled)"
    lines.append(f"roles (warm: {settled} the first step; rss.csv every {SAMPLE_EVERY_S:.0f}s):")
    lines.append(f"{'role':<13} {'procs':>5} {'RSS MiB warm':>12} {'end':>8} {'x':>5} "
                 f"{'fds warm':>8} {'end':>5} {'sockets warm':>12} {'end':>5}")  # fmt: skip
    for role in sorted(set(out["warm"]) | set(out["end"])):
        w = out["warm"].get(role, (0, 0.0, 0, 0))
        e = out["end"].get(role, (0, 0.0, 0, 0))
        lines.append(
            f"{role:<13} {e[0]:>5} {w[1]:>12.0f} {e[1]:>8.0f} {ratio(e[1], w[1]):>5} "
            f"{w[2]:>8} {e[2]:>5} {w[3]:>12} {e[3]:>5}"
        )
    n = max(acc.started, 1)
    lines.append(
        f"per episode: screenshots {back['shots']['bytes'] / n / 1024:.1f} KiB "
        f"({back['shots']['images']} images), database {back['db_bytes'] / n / 1024:.1f} KiB "
        f"(file {back['db_bytes'] / 2**20:.1f} MiB over {acc.started} episodes)"
    )
    lost = len(back["lost"]) + max(box_gap, 0)
    dup = sum(integ[k] for k in DUPS)
    lines.append(verdict(acc, out["gym_live"], lost, dup, integ["open_environments"]))
    if out["early_exit"] or not acc.finished:
        lines[-1] = "verdict: FAIL: the training did not run to the deadline (see logs/train.log)"
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/soak.py", description=__doc__)
    parser.add_argument("--minutes", type=float, default=20.0, help="training time, warm-up in")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="rollout.max_concurrent_rollouts"
    )
    parser.add_argument("--step-latency", type=float, default=0.5, help="the agent's, per action")
    parser.add_argument("--model", default="qwen2-vl-bpe")
    parser.add_argument("--run-dir", default="", help="default runs/soak-<time>")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1:
        parser.error("--minutes must be positive and --concurrency >= 1")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = (ROOT / (args.run_dir or f"runs/soak-{stamp}")).resolve()
    stack = Stack(args, run_dir)

    def log(msg: str) -> None:
        print(f"[soak {time.monotonic() - stack.t0:6.0f}s] {msg}", flush=True)

    try:
        out = run(args, stack, log)
        back = read_back(stack, out["faults"])
    finally:
        stack.stop()
    lines = report(out, back, stack)
    for line in lines:
        print(line, flush=True)
    print(f"[soak] run folder: {run_dir} (logs/, areal/logs/, monitor.db)", flush=True)
    return 0 if lines[-1].startswith("verdict: OK") else 1


if __name__ == "__main__":
    sys.exit(main())
