"""The local agent service's runs: each ``POST /runs`` is a task running the shared agent loop
(``cua_rl.agent``), kept for the GET routes until ``max_runs_kept`` newer ones end.

A run's record moves to disk as soon as it ends (``Run.spill``, into unnamed files freed when
the service stops or dies): the driver reads it once more after the end, nothing reads it often, and
in memory the finished runs' screenshots and token ids were what grew the service (docs/soak.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from cua_rl.agent.context import DEFAULT_HISTORY_N, POLICIES
from cua_rl.agent.loop import AgentLoop, LoopConfig
from cua_rl.agent.run import Run, validate_run_body
from cua_rl.core.fields import doc
from cua_rl.core.spill import Spill
from cua_rl.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class AgentServerConfig(LoopConfig):
    """Settings of the local agent service: the loop's, and the server's own."""

    max_runs_kept: int = doc(512, "finished runs kept for GET before the oldest are dropped")
    spill_dir: str = doc(
        "",
        "directory of the files holding finished runs' records (unnamed temporary files, freed "
        "when the service stops or dies); empty: the system's temporary directory",
    )
    context: str = doc(
        "full",
        "context policy of runs whose model object names none: full (append-only), mai-ui "
        "(rebuilt each step, re-rendered history, last history_n screenshots, re-asks) or "
        "current (current screenshot + list of earlier actions); docs/agent.md",
    )
    history_n: int = doc(
        DEFAULT_HISTORY_N, "mai-ui context: screenshots per request, the current one included"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_runs_kept < 1:
            raise ConfigError(f"max_runs_kept must be >= 1, got {self.max_runs_kept}")
        if self.context not in POLICIES:
            raise ConfigError(f"context must be one of {', '.join(POLICIES)}, got {self.context!r}")
        if self.history_n < 1:
            raise ConfigError(f"history_n must be >= 1, got {self.history_n}")


class AgentService:
    """Runs agent loops; one instance per server."""

    def __init__(
        self, config: AgentServerConfig | None = None, client: httpx.AsyncClient | None = None
    ):
        self.config = config or AgentServerConfig()
        self.loop = AgentLoop(
            self.config, client, context=self.config.context, history_n=self.config.history_n
        )
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self._ids = itertools.count(1)
        self.spill = Spill(self.config.spill_dir)
        self.spill_errors = 0
        self._closing = False

    async def aclose(self) -> None:
        self._closing = True
        for run in list(self.runs.values()):
            if run.task and not run.task.done():
                run.task.cancel()
        await self.loop.aclose()
        self.spill.close()

    def start(self, body: dict) -> Run:
        validate_run_body(body)
        run_id = f"run-{int(time.time())}-{next(self._ids)}"
        run = Run(run_id, body)
        self.runs[run_id] = run
        self._forget_old()
        run.task = asyncio.create_task(self.loop.run(run), name=run_id)
        run.task.add_done_callback(lambda _task: self._finished(run))
        return run

    def _finished(self, run: Run) -> None:
        """Spill the ended run's record; a disk error keeps it in memory, counted and logged."""
        if self._closing or run.id not in self.runs:
            return
        try:
            run.spill(self.spill)
        except (OSError, TypeError, ValueError) as e:  # the disk, or a value JSON cannot hold
            self.spill_errors += 1
            log.warning("run %s kept in memory, not spilled: %s", run.id, e)

    def memory(self) -> dict:
        """What the kept runs hold: how many keep their record in memory, and the bytes on disk."""
        spilled = [r.spilled.size for r in self.runs.values() if r.spilled is not None]
        return {
            "runs_in_memory": len(self.runs) - len(spilled),
            "spilled_bytes": sum(spilled),
            "disk_bytes": self.spill.disk_bytes,
            "spill_errors": self.spill_errors,
        }

    def _forget_old(self) -> None:
        while len(self.runs) > self.config.max_runs_kept:
            oldest_id = next(
                (rid for rid, r in self.runs.items() if r.task is None or r.task.done()), None
            )
            if oldest_id is None:
                return
            run = self.runs.pop(oldest_id)
            if run.spilled is not None:
                self.spill.remove(run.spilled)
