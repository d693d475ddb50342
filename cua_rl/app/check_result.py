"""One line of ``--check``'s report: a service or setting, whether it passed, and the detail.

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

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name:<8} {self.detail}"
