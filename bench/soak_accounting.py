"""The soak's pure pieces: the fault schedule, the accounting of episodes, the verdict.

``bench/soak.py`` runs the stack and injects the faults; everything here works on what it read
back (the monitor's rows, the rollout worker's log lines), so tests/bench/test_soak.py checks it
on hand-made inputs.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

FAULT_KINDS = (
    "gym_5xx",
    "slow_create",
    "agent_kill",
    "monitor_kill",
    "model_drop",
    "model_outage",
)
# How long each fault lasts (seconds); a kill's is the time until the restart.
FAULT_SECONDS = {
    "gym_5xx": 20.0,
    "slow_create": 30.0,
    "agent_kill": 5.0,
    "monitor_kill": 15.0,
    "model_drop": 0.0,
    "model_outage": 15.0,
}
# An episode in flight when a fault ends may still fail of it later (a timeout, a retry
# exhausted): a rejection this long after a fault's end still falls under it.
AFTERMATH_S = 60.0

ROLE_MARKS = (
    ("vllm", "cua_rl.inference.vllm_server"),
    ("actor", "--role actor"),
    ("rollout", "--role rollout"),
    ("eval-rollout", "--role eval-rollout"),
    ("trainer", "examples.cua_agent.train"),
)
UUID_LINE = re.compile(r"episode ([0-9a-f-]{36}) (rejected|failed): (.*)")
SURPLUS_LINE = re.compile(r"episode ([0-9a-f-]{36}) samples policy version \d+ after the last")


# ---------------------------------------------------------------------------- pure pieces


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float  # seconds after the run's start
    seconds: float

    @property
    def end_s(self) -> float:
        return self.at_s + self.seconds


def fault_schedule(start_s: float, end_s: float, kinds=FAULT_KINDS) -> list[Fault]:
    """Faults evenly spaced in [start_s, end_s), the kinds in turn, each over before end_s.

    The gap between two faults is the longest fault plus a quiet minute's share, so faults never
    overlap and each one's rejections can be told apart; too short a span gets fewer faults."""
    if end_s <= start_s:
        return []
    longest = max(FAULT_SECONDS[k] for k in kinds)
    gap = longest + 15.0
    out: list[Fault] = []
    t = start_s
    while t + longest <= end_s:
        kind = kinds[len(out) % len(kinds)]
        out.append(Fault(kind, t, FAULT_SECONDS[kind]))
        t += gap
    return out


@dataclass
class Episode:
    rollout_id: str
    status: str
    reason: str
    end_s: float | None  # seconds after the run's start; None while open


@dataclass
class Accounting:
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    open: int = 0
    rejected: Counter = field(default_factory=Counter)
    by_fault: dict[int, Counter] = field(default_factory=dict)  # fault index -> reasons
    unexplained: list[Episode] = field(default_factory=list)

    @property
    def explained(self) -> int:
        return sum(sum(c.values()) for c in self.by_fault.values())


def fault_for(end_s: float, faults: list[Fault]) -> int | None:
    """The fault a rejection at ``end_s`` falls under: the last one begun before it whose window
    (its span plus ``AFTERMATH_S``) holds it."""
    for i in range(len(faults) - 1, -1, -1):
        f = faults[i]
        if f.at_s <= end_s <= f.end_s + AFTERMATH_S:
            return i
    return None


def account(episodes: list[Episode], faults: list[Fault]) -> Accounting:
    acc = Accounting(started=len(episodes))
    for ep in episodes:
        if ep.status == "completed":
            acc.finished += 1
        elif ep.status == "cancelled":
            acc.cancelled += 1
        elif ep.status == "failed":
            acc.rejected[ep.reason or "(no reason)"] += 1
            i = None if ep.end_s is None or not ep.reason else fault_for(ep.end_s, faults)
            if i is None:
                acc.unexplained.append(ep)
            else:
                acc.by_fault.setdefault(i, Counter())[ep.reason] += 1
        else:
            acc.open += 1
    return acc


def lost_records(worker: dict[str, str], recorded: dict[str, tuple[str, str]]) -> list[str]:
    """The rollout worker's rejected or failed episodes (uuid -> reason) the monitor lacks or
    recorded otherwise (uuid -> (status, reason)); one line each."""
    out = []
    for uuid, reason in sorted(worker.items()):
        got = recorded.get(uuid)
        if got is None:
            out.append(f"{uuid}: rejected ({reason}) by the worker, absent from the monitor")
        elif got[0] != "failed":
            out.append(f"{uuid}: rejected ({reason}) by the worker, {got[0]} in the monitor")
    return out


def verdict(acc: Accounting, gym_live: int, lost: int, duplicated: int, open_envs: int) -> str:
    problems = []
    if acc.unexplained:
        problems.append(f"{len(acc.unexplained)} rejections under no fault")
    if acc.open or open_envs:
        problems.append(f"{acc.open} rollouts and {open_envs} environments still open")
    if gym_live:
        problems.append(f"{gym_live} gym executions alive")
    if lost:
        problems.append(f"{lost} records lost")
    if duplicated:
        problems.append(f"{duplicated} records duplicated")
    if not problems:
        return "verdict: OK: every rejection falls under a fault with a reason; nothing else lost"
    return "verdict: FAIL: " + "; ".join(problems)


def role_of(cmdlines: list[str]) -> str | None:
    """A process's role from its own command line, then its ancestors' (nearest first)."""
    for cmd in cmdlines:
        for role, mark in ROLE_MARKS:
            if mark in cmd:
                return role
    return None


def ratio(n: float, d: float) -> str:
    return f"{n / d:.2f}" if d else "n/a"


def worker_view(lines) -> tuple[dict[str, str], set[str]]:
    """The rollout worker's own view, from its log lines: the episodes it rejected (uuid ->
    the error's text) and the surplus episodes it did not record."""
    rejected: dict[str, str] = {}
    surplus: set[str] = set()
    for line in lines:
        if m := UUID_LINE.search(line):
            rejected[m.group(1)] = m.group(3)[:120]
        elif m := SURPLUS_LINE.search(line):
            surplus.add(m.group(1))
    return rejected, surplus


def seconds_after(stamp: str | None, t0_utc: datetime) -> float | None:
    if not stamp:
        return None
    at = datetime.fromisoformat(str(stamp))
    if at.tzinfo is not None:
        at = at.astimezone(UTC).replace(tzinfo=None)
    return (at - t0_utc) / timedelta(seconds=1)


def utc_now() -> datetime:
    """Naive UTC, as the monitor stores its timestamps."""
    return datetime.now(UTC).replace(tzinfo=None)
