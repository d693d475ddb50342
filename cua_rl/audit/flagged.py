"""Training leaves out the tasks an audit flagged (``curriculum.skip_flagged``, off by default).

The flagged tasks come from the audit's JSON report (``curriculum.audit_file``) or, without one,
from the newest completed audit of the training's gym (``gym.gym_id``) that its monitor recorded:
over HTTP at ``monitor.base_url``, or read from the embedded monitor's ``monitor.db_path``. A
switch that finds no audit is a configuration error (training on unaudited tasks while asking
to leave out the flagged ones would say nothing); tasks the audit never saw train as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cua_rl.errors import ConfigError
from cua_rl.monitor.protocol import AUDIT_FLAGS
from cua_rl.tasks import Task


@dataclass(frozen=True)
class Flagged:
    tasks: dict[str, str]  # task id -> verdict
    source: str  # where they were read, in words


def from_file(path: str) -> Flagged:
    p = Path(path)
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
        audit = report["audit"]
        tasks = {t["task_id"]: t["verdict"] for t in report["tasks"]}
    except FileNotFoundError:
        raise ConfigError(
            f"curriculum.audit_file={path!r} does not exist: run python -m cua_rl.audit "
            "--config ... first (it prints where its report is)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"curriculum.audit_file={path!r} is not an audit report ({type(exc).__name__}: "
            f"{exc}); give the JSON python -m cua_rl.audit wrote"
        ) from None
    if audit.get("status") != "completed":
        raise ConfigError(
            f"curriculum.audit_file={path!r} is an audit that did not complete "
            f"({audit.get('status')}); run the audit to its end"
        )
    flagged = {t: v for t, v in tasks.items() if v in AUDIT_FLAGS}
    return Flagged(flagged, f"{path} ({len(tasks)} tasks audited)")


def from_monitor(config: Any) -> Flagged:
    """The newest completed audit of ``gym.gym_id`` in the training's monitor."""
    gym_id, m = config.gym.gym_id, config.monitor
    url, token = m.resolved()
    if url:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            resp = httpx.get(
                f"{url.rstrip('/')}/api/audits/flagged",
                params={"gym_id": gym_id},
                headers=headers,
                timeout=30,
            )
            resp.raise_for_status()
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ConfigError(
                f"curriculum.skip_flagged: the monitor at {url} did not answer its audits "
                f"({type(exc).__name__}: {exc}); set curriculum.audit_file to the audit's report"
            ) from None
        audit, rows = body.get("audit"), body.get("tasks") or []
        where = url
    elif m.db_path and Path(m.db_path).is_file():
        from cua_rl.monitor.server.audits import flagged_tasks
        from cua_rl.monitor.server.migrations import connect

        conn = connect(m.db_path, read_only=True)
        try:
            audit, rows = flagged_tasks(conn, gym_id)
        finally:
            conn.close()
        where = m.db_path
    else:
        raise ConfigError(
            "curriculum.skip_flagged needs an audit: set curriculum.audit_file to the report "
            "python -m cua_rl.audit wrote, or record the audit in this training's monitor "
            "(monitor.base_url or monitor.db_path)"
        )
    if audit is None:
        raise ConfigError(
            f"curriculum.skip_flagged: the monitor at {where} holds no completed audit of gym "
            f"{gym_id!r}; run python -m cua_rl.audit --config ... with this config first, or "
            "set curriculum.audit_file"
        )
    flagged = {r["task_id"]: r["verdict"] for r in rows}
    return Flagged(flagged, f"audit {audit['client_id']} in the monitor at {where}")


def leave_out_flagged(config: Any, tasks: list[Task]) -> tuple[list[Task], Flagged | None]:
    """``tasks`` without the flagged ones when ``curriculum.skip_flagged`` is on."""
    c = config.curriculum
    if not c.skip_flagged:
        return tasks, None
    flagged = from_file(c.audit_file) if c.audit_file else from_monitor(config)
    return [t for t in tasks if t.id not in flagged.tasks], flagged


def left_out_line(tasks: list[Task], kept: list[Task], flagged: Flagged) -> str:
    gone = [t.id for t in tasks if t.id in flagged.tasks]
    if not gone:
        return f"audit: no task of this source is flagged ({flagged.source})"
    names = ", ".join(f"{t} ({flagged.tasks[t]})" for t in gone[:10])
    more = f", ... {len(gone) - 10} more" if len(gone) > 10 else ""
    return (
        f"audit: leaving out {len(gone)} flagged tasks of {len(tasks)}: {names}{more} "
        f"(curriculum.skip_flagged, from {flagged.source})"
    )
