"""What ``make demo`` shows in the terminal while it trains: progress read from the monitor.

The trainer's and AReaL's workers' output goes to log files; the terminal gets one live line
(the step of N and the phase that step is in, its episodes finished / running / rejected, the
last reward and success) and, once a step is recorded completed, one summary line with rounded
numbers: the batch it trained on (its episodes, their rows and trained tokens), and the training
episodes that finished since the step before (counts, reward and success; an asynchronous step
trains on a batch that finished earlier, so the two differ). Everything is read from the
monitor's SQLite file (read-only, so it never contends with the writer), which
already holds all of it: no change to the trainer's output is needed.

On a terminal the live line is redrawn in place; elsewhere (a pipe, CI) it is printed as a line
when it changes, at most every ``quiet_s`` seconds. Every change of it, unthinned, can also go to
a log file (``log_path``: the demo's ``logs/progress.log``), each line after the local time it
was read.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import TextIO

from cua_rl.audit.live import warning_line
from cua_rl.monitor.protocol import TERMINAL
from cua_rl.monitor.server.read import MonitorReader
from cua_rl.monitor.server.views import parse_time, seconds_between

_DONE = ("completed",)
_REJECTED = ("failed",)
# Episodes in flight when the training ends are stopped, not rejected (asynchronous runs always
# have some: the next steps' rollouts).
_STOPPED = ("cancelled",)


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    text = f"{value:.{digits}f}"
    return "0" if text in ("-0", "-0.0", "-0.00") else text


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


class DemoProgress:
    """Poll the monitor database and write the live line and the per-step summaries."""

    def __init__(
        self,
        db_path: str | Path,
        out: TextIO | None = None,
        *,
        prefix: str = "",
        quiet_s: float = 15.0,
        log_path: str | Path | None = None,
    ):
        self.db_path = Path(db_path)
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115
        self._last_logged = ""
        self.prefix = prefix
        self.out = out or sys.stdout
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.quiet_s = quiet_s
        self.summarised: set[int] = set()
        self._last_line = ""
        self._last_print: float | None = None
        self._drawn = False
        self._read: MonitorReader | None = None

    def _db(self) -> MonitorReader | None:
        if self._read is None:
            if not self.db_path.exists():
                return None
            self._read = MonitorReader(self.db_path, timeout_s=2)
        return self._read

    def close(self) -> None:
        self._clear()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._read is not None:
            self._read.close()
            self._read = None

    # ------------------------------------------------------------------ output

    def _clear(self) -> None:
        if self.tty and self._drawn:
            self.out.write("\r\x1b[2K")
            self.out.flush()
            self._drawn = False

    def say(self, line: str) -> None:
        """A permanent line (the live line is redrawn below it)."""
        self._clear()
        self.out.write(self.prefix + line + "\n")
        self.out.flush()

    def _live(self, line: str) -> None:
        if self._log is not None and line != self._last_logged:
            self._log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            self._log.flush()
            self._last_logged = line
        line = self.prefix + line
        if self.tty:
            self.out.write("\r\x1b[2K" + line[:200])
            self.out.flush()
            self._drawn = True
            return
        now = time.monotonic()
        # The first line goes out at once (monotonic time may start near 0, at boot).
        quiet = self._last_print is not None and now - self._last_print < self.quiet_s
        if line != self._last_line and not quiet:
            self.out.write(line + "\n")
            self.out.flush()
            self._last_line, self._last_print = line, now

    # ------------------------------------------------------------------ reading

    def tick(self) -> None:
        """Read the database once; print new step summaries and redraw the live line."""
        try:
            db = self._db()
            if db is None:
                return
            training = db.latest_training()
            if training is None:
                return
            for line in self.step_summaries(db, training):
                self.say(line)
            if training["status"] in TERMINAL["training"]:
                self._clear()
                return
            live = self.live_line(db, training)
            if live:
                self._live(live)
        except sqlite3.Error:
            return  # the file is being created or migrated: next tick

    def step_summaries(self, db: MonitorReader, training: dict) -> list[str]:
        lines = []
        total = training["total_steps"]
        prev_end = None
        for s in db.finished_steps(training["id"]):
            if s["step"] in self.summarised:
                prev_end = s["end_time"]
                continue
            self.summarised.add(s["step"])
            metrics = _metrics(s["metrics_json"])
            if s["status"] == "failed":
                lines.append(f"step {s['step']}/{total or '?'} failed: {s['error_message'] or ''}")
                continue
            # What the step trained on, then the episodes that finished since the step before
            # (asynchronous steps train on batches finished earlier, so the two differ). The
            # step record's reward columns describe the latter when it holds any episode.
            # AReaL's task reward is the group-normalised one (the group filter writes it):
            # the reward shown is the episodes', from the workflow's own stats.
            rows = metrics.get("ppo_actor/n_seqs")
            done, rejected = self._finished(db, training["id"], prev_end, s["end_time"])
            prev_end = s["end_time"]
            finished = f"finished since the step before: {done} accepted, {rejected} rejected"
            if "rollout/cua/reward" in metrics:
                finished += f", reward {_fmt(metrics['rollout/cua/reward'])}"
                if s["reward_std"] is not None:
                    finished += f" ± {_fmt(s['reward_std'])}"
            success = metrics.get("rollout/cua/success")
            if success is not None:
                finished += f", success {_pct(success)}"
            parts = [
                f"trained on {int(s['num_trajectories'] or 0)} episodes"
                + (f" ({int(rows)} rows)" if rows is not None else "")
                + f", {int(s['num_tokens'] or 0)} tokens",
                finished,
            ]
            if s["eval_success"] is not None:
                parts.append(f"eval success {_pct(s['eval_success'])}")
            took = seconds_between(s["start_time"], s["end_time"])
            if took is not None:
                parts.append(f"{took:.0f}s")
            lines.append(f"step {s['step']}/{total or '?'}: " + ", ".join(parts))
            # Rewarded episodes in which no action changed the state (docs/audit.md).
            warning = warning_line(s["step"], metrics)
            if warning:
                lines.append(warning)
        return lines

    def _finished(self, db: MonitorReader, training_id: int, after, until) -> tuple[int, int]:
        """(accepted, rejected) training episodes that ended in ``(after, until]``."""
        lo, hi = parse_time(after), parse_time(until)
        done = rejected = 0
        for r in db.training_rollout_ends(training_id):
            status, t = r["status"], parse_time(r["end_time"])
            if t is None or hi is None or t > hi or (lo is not None and t <= lo):
                continue
            done += status in _DONE
            rejected += status in _REJECTED
        return done, rejected

    def _counts(self, db: MonitorReader, kind: str, source_id: int) -> dict[str, int]:
        counts = {"done": 0, "running": 0, "rejected": 0, "stopped": 0}
        for status, n in db.rollout_counts(kind, source_id).items():
            key = (
                "done"
                if status in _DONE
                else "rejected"
                if status in _REJECTED
                else "stopped"
                if status in _STOPPED
                else "running"
            )
            counts[key] += n
        return counts

    def live_line(self, db: MonitorReader, training: dict) -> str:
        total = training["total_steps"] or "?"
        # The newest open pass: a baseline or eval runs between steps.
        source = label = phase = None
        for kind in ("baseline", "eval"):
            row = db.running_pass(kind, training["id"])
            if row:
                source = (kind, row["id"])
                label = (
                    "baseline (before step 1)"
                    if kind == "baseline"
                    else f"eval after step {row['step']}/{total}"
                )
                phase = _phase(row["current_phase"], "evaluation")
        if source is None:
            step = db.last_step(training["id"])
            if step is None:
                started = training["current_phase"] or training["status"]
                return f"starting: AReaL workers and the vLLM server ({started})"
            label = f"step {step['step']}/{total}"
            source = ("step", step["id"])
            # The step's own phase: the training's is whatever was set last, by a step or a pass.
            phase = _phase(step["current_phase"] or step["status"], "rollout")
        counts = self._counts(db, *source)
        last = db.last_completed_rollout(*source)
        text = (
            f"{label} · {phase} · episodes {counts['done']} finished, {counts['running']} running, "
            f"{counts['rejected']} rejected"
        )
        if last is not None:
            success = (
                "–" if last["task_success"] is None else ("yes" if last["task_success"] else "no")
            )
            text += f" · last reward {_fmt(last['reward'])}, success {success}"
        return text


# The monitor's phase words (cua_rl/monitor/worker/training.py) as the line shows them:
# ``checkpointing`` is the hooks' name for AReaL's update_weights.
_PHASES = {
    "rollout_execution": "rollout",
    "rollout_running": "rollout",
    "checkpointing": "weight update",
}


def _phase(recorded: str | None, otherwise: str) -> str:
    return _PHASES.get(recorded or "", recorded or otherwise)


def _metrics(text: str | None) -> dict[str, float]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
