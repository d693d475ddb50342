"""What an audit shows: a progress line per task as it ends, the table, the JSON report.

The terminal gets one line per audited task while the audit runs (its verdict and how many of
each agent's runs were rewarded), then the table of every task with the first flag's message,
the counts per verdict and whether every box was terminated. The JSON holds everything: the
audit's settings and counts, and per task its verdict, flags with their evidence (agent, plan,
score, validators' messages, execution id), the plans and every run.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from cua_rl.audit.session import TaskResult
from cua_rl.audit.verdict import LABELS, VERDICTS

AGENT_ORDER = ("stop", "wait", "random", "infeasible", "replay", "ablation", "answer")


def agents_line(result: TaskResult) -> str:
    """``stop 0/3 wait 0/3 ...``: rewarded runs of each agent (``n/a`` when skipped)."""
    parts = []
    for agent in AGENT_ORDER:
        s = result.verdict.summary.get(agent)
        if s is not None:
            errors = f" ({s['errors']} failed)" if s["errors"] else ""
            parts.append(f"{agent} {s['rewarded']}/{s['runs']}{errors}")
        elif agent in result.skipped:
            parts.append(f"{agent} n/a")
    return " ".join(parts)


class Progress:
    """Prints each task's line as it ends (``[k/N]``), then the table."""

    def __init__(self, total: int, out: TextIO = sys.stdout, width: int = 24):
        self.total, self.out, self.done = total, out, 0
        self.width = width  # the longest task id
        self.started = time.monotonic()

    def task(self, result: TaskResult) -> None:
        self.done += 1
        label = LABELS[result.verdict.verdict]
        print(
            f"[{self.done:>{len(str(self.total))}}/{self.total}] {result.task.id:<{self.width}} "
            f"{label:<24} {agents_line(result)}  (at {time.monotonic() - self.started:.0f}s)",
            file=self.out,
            flush=True,
        )

    def table(self, results: Sequence[TaskResult]) -> None:
        flagged = [r for r in results if r.verdict.flagged or r.verdict.verdict == "unchecked"]
        if not flagged:
            return
        print("\nflagged tasks:", file=self.out)
        for r in flagged:
            print(f"  {r.task.id}: {LABELS[r.verdict.verdict]}", file=self.out)
            for f in r.verdict.flags[:3]:
                print(f"    - [{f.agent}] {f.message}", file=self.out)
            if len(r.verdict.flags) > 3:
                print(f"    - ... {len(r.verdict.flags) - 3} more in the JSON", file=self.out)
            if r.verdict.verdict == "unchecked":
                errors = [run.error for run in r.runs if run.error]
                print(
                    f"    - every run failed in the gym: {errors[0] if errors else '?'}",
                    file=self.out,
                )


def counts(results: Sequence[TaskResult]) -> dict[str, int]:
    found = Counter(r.verdict.verdict for r in results)
    return {v: found.get(v, 0) for v in VERDICTS}


def summary_line(results: Sequence[TaskResult], total: int, seconds: float, boxes: dict) -> str:
    c = counts(results)
    runs = sum(len(r.runs) for r in results)
    errors = sum(1 for r in results for run in r.runs if run.error)
    found = ", ".join(f"{n} {LABELS[v]}" for v, n in c.items() if n) or "nothing"
    left = boxes["open"] + boxes["terminate_failed"]
    closed = (
        f"all {boxes['created']} boxes terminated"
        if not left
        else f"{boxes['open']} boxes still open and {boxes['terminate_failed']} not terminated"
    )
    return (
        f"audited {len(results)} of {total} tasks in {seconds:.0f}s ({runs} runs, {errors} failed "
        f"in the gym; {closed}): {found}"
    )


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Written whole or not at all: a temporary file renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    tmp.replace(path)
