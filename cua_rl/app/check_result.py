"""One line of ``--check``'s report: a service or setting, whether it passed (or was skipped, not
looked at), and the detail.

Its own module so that the checks living beside ``check.py`` (cluster paths, the inference
environment, the GPU step) share it without importing the module that imports them;
``tool_report`` runs the helper processes of the last two.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    # Not looked at (nothing to look at, or not from here): never reported as ``ok``.
    skipped: bool = False

    @classmethod
    def skip(cls, name: str, why: str) -> CheckResult:
        return cls(name, True, why, skipped=True)

    def line(self) -> str:
        mark = "skip" if self.skipped else "ok  " if self.ok else "FAIL"
        return f"{mark} {self.name:<8} {self.detail}"


def tool_report(cmd: list[str], *, env: dict[str, str], timeout_s: float, prefix: str):
    """Run a check's helper process; its report is the JSON after ``prefix`` on its last such
    line. Returns (report, "") or (None, why there is none: the exit code and the last line)."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix) :]), ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return None, f"exited with code {proc.returncode}: {tail[0][:300]}"
