"""Where the curriculum reads outcomes: the Training Monitor, the run's warehouse.

Every episode's rollout record already reaches the monitor from whichever rollout worker ran it,
with its task, reward, success and step, and survives a restart of the training. The selector
keeps none of it: each draw reads the run's outcomes again, aggregated by the monitor per task
and step (``GET /api/task-outcomes?run_name=``), so every process sees the same facts and a
resumed run sees what the first one recorded. The policy version of step ``s`` is ``s - 1``
(``cua_rl/rollout/placement.py``).
"""

from __future__ import annotations

from typing import Protocol

import httpx

from cua_rl.curriculum.selector import Outcome
from cua_rl.errors import MonitorError


class OutcomeSource(Protocol):
    def fetch(self) -> list[Outcome]:
        """Every outcome recorded so far; raises ``MonitorError`` when they cannot be read."""
        ...


def parse_outcomes(payload: object) -> list[Outcome]:
    """The monitor's answer -> outcomes. A malformed answer is a ``MonitorError``."""
    rows = payload.get("outcomes") if isinstance(payload, dict) else None
    if not isinstance(rows, list):
        raise MonitorError(f"task outcomes: expected {{'outcomes': [...]}}, got {payload!r:.200}")
    out = []
    for row in rows:
        try:
            out.append(
                Outcome(
                    task_id=str(row["task_id"]),
                    version=int(row["step"]) - 1,
                    n=int(row["n"]),
                    successes=float(row["successes"] or 0),
                    reward_sum=float(row["reward_sum"] or 0),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise MonitorError(f"task outcomes: bad row {row!r:.200} ({exc})") from None
    return out


class MonitorOutcomes:
    """Reads a run's outcomes from a monitor over HTTP (synchronous: the trainer's data loader
    draws in a plain thread). A run the monitor has not recorded yet has no outcomes."""

    def __init__(
        self,
        base_url: str,
        run_name: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = f"{base_url.rstrip('/')}/api/task-outcomes"
        self.run_name = run_name
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers, transport=transport)

    def fetch(self) -> list[Outcome]:
        try:
            resp = self._client.get(self.url, params={"run_name": self.run_name})
        except httpx.HTTPError as exc:
            raise MonitorError(f"task outcomes from {self.url}: {exc!r}") from None
        if resp.status_code != 200:
            raise MonitorError(
                f"task outcomes from {self.url}: HTTP {resp.status_code}",
                status=resp.status_code,
                body=resp.text[:500],
            )
        try:
            payload = resp.json()
        except ValueError:
            raise MonitorError(f"task outcomes from {self.url}: not JSON") from None
        return parse_outcomes(payload)

    def close(self) -> None:
        self._client.close()
