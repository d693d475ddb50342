"""An audit's records in the Training Monitor: its header as it runs, each task's verdict.

Through the training's own ``MonitorClient`` (batched, retried, spooled while the monitor is
down): an ``audits`` record when the audit starts, an ``audit_tasks`` record and a progress update
as each task ends, and the final status with the counts. The dashboard shows them at
``/audits`` (docs/monitor.md); a training with ``curriculum.skip_flagged`` reads the newest
completed audit of its gym from there.
"""

from __future__ import annotations

from typing import Any

from cua_rl.audit.session import TaskResult
from cua_rl.monitor.protocol import AUDIT_KIND, AUDIT_TASK_KIND
from cua_rl.monitor.worker.batches import utc_now


class AuditRecord:
    """``client`` None: nothing is recorded."""

    def __init__(self, client: Any, audit_id: str):
        self.client, self.audit_id = client, audit_id
        self.done = self.flagged = 0

    def _audit(self, **fields: Any) -> None:
        if self.client is not None:
            self.client.enqueue(AUDIT_KIND, {"client_id": self.audit_id, **fields})

    def started(
        self, *, gym_base_url: str, gym_id: str, config_path: str, total: int, settings: dict
    ) -> None:
        self._audit(
            status="running",
            gym_base_url=gym_base_url,
            gym_id=gym_id,
            config_path=config_path,
            tasks_total=total,
            tasks_done=0,
            flagged=0,
            settings=settings,
            started_at=utc_now(),
        )

    def task(self, result: TaskResult) -> None:
        self.done += 1
        self.flagged += int(result.verdict.flagged)
        if self.client is None:
            return
        data = result.to_json()
        self.client.enqueue(
            AUDIT_TASK_KIND,
            {
                "audit_client_id": self.audit_id,
                "task_id": data["task_id"],
                "name": data["name"],
                "verdict": data["verdict"],
                "flags": data["flags"],
                "summary": data["summary"],
                "skipped": data["skipped"],
                "runs": data["runs"],
                "seconds": data["seconds"],
            },
        )
        self._audit(tasks_done=self.done, flagged=self.flagged)

    def finished(self, status: str, *, counts: dict, executions: dict, message: str = "") -> None:
        self._audit(
            status=status,
            counts=counts,
            executions=executions,
            tasks_done=self.done,
            flagged=self.flagged,
            message=message,
            finished_at=utc_now(),
        )
