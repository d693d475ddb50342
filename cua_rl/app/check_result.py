"""One line of ``--check``'s report: a service or setting, whether it passed (or was skipped, not
looked at), and the detail.

Its own module so that the checks living beside ``check.py`` (cluster paths, the GPU stack)
share it without importing the module that imports them.
"""

from __future__ import annotations

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
