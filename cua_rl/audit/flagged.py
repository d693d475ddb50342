"""Training leaves out the tasks an audit flagged (``curriculum.skip_flagged``, off by default).

They are left out of the train and eval tasks ``gym.selection`` picks (after it, so a selection
may name a flagged task). The flagged tasks come from the audit's JSON report
(``curriculum.audit_file``) or, without one, from the newest completed audit of the training's
gym (``gym.gym_id``) that its monitor recorded: over HTTP at ``monitor.base_url``, or read from
the embedded monitor's ``monitor.db_path``. A switch that finds no audit is a configuration
error (training on unaudited tasks while asking to leave out the flagged ones would say
nothing); tasks the audit never saw train as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cua_rl.errors import ConfigError, TaskSelectionError
from cua_rl.monitor.protocol import AUDIT_FLAGS
from cua_rl.tasks import Task, TaskSplit, select_tasks


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


def flagged_of(config: Any) -> Flagged | None:
    """The flagged tasks ``curriculum.skip_flagged`` leaves out (None when it is off)."""
    c = config.curriculum
    if not c.skip_flagged:
        return None
    return from_file(c.audit_file) if c.audit_file else from_monitor(config)


def select_unflagged(config: Any, tasks: list[Task]) -> tuple[TaskSplit, str]:
    """``gym.selection``'s split, then without the flagged tasks; the line that says what was
    left out ("" when the switch is off). Left out after the selection, so a selection may name
    a flagged task; a train split left empty is an error that says so."""
    split = select_tasks(tasks, config.gym.selection)
    flagged = flagged_of(config)
    if flagged is None:
        return split, ""
    kept = TaskSplit(
        [t for t in split.train if t.id not in flagged.tasks],
        [t for t in split.eval if t.id not in flagged.tasks],
    )
    selected = {t.id for t in (*split.train, *split.eval)}
    gone = sorted(t for t in selected if t in flagged.tasks)
    if not kept.train:
        raise TaskSelectionError(
            f"every train task the selection picks is flagged by the audit ({', '.join(gone)}; "
            f"{flagged.source}): fix them (docs/audit.md), select others, or set "
            "curriculum.skip_flagged=false"
        )
    if not gone:
        return kept, f"audit: no selected task is flagged ({flagged.source})"
    names = ", ".join(f"{t} ({flagged.tasks[t]})" for t in gone[:10])
    more = f", ... {len(gone) - 10} more" if len(gone) > 10 else ""
    return kept, (
        f"audit: leaving out {len(gone)} flagged of the {len(selected)} selected tasks: "
        f"{names}{more} (curriculum.skip_flagged, from {flagged.source})"
    )
