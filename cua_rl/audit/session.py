"""One audit: every task's plans run through the gym, judged, reported as each task ends.

``Audit.run(tasks)`` audits the tasks concurrently (the runner's semaphore bounds the boxes
open at once); for each task it reads the task's detail (whether it reads an answer, its known
solution), asks the monitor's warehouse for recorded successes, runs every plan ``repeats``
times, then the replays' ablations, judges the runs (``verdict.judge``) and hands the result to
the observers (the terminal table, the monitor). A cancelled audit (SIGINT, SIGTERM) stops its
runs, whose boxes are terminated on the way out, and reports the tasks it finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cua_rl.audit import plans as P
from cua_rl.audit.config import AuditConfig
from cua_rl.audit.runner import Run, Runner, box_routes_missing, detail_flag
from cua_rl.audit.verdict import TaskVerdict, judge
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import GymError, MonitorError
from cua_rl.logs import get_logger
from cua_rl.tasks import Task
from cua_rl.warehouse.episode import StoredEpisodeError

log = get_logger(__name__)

# Agents whose plans act on the box (the gym's screenshot and action routes).
BOX_AGENTS = ("wait", "random", "replay", "ablation")
Successes = Callable[[str], Awaitable[list[Any]]]


@dataclass
class TaskResult:
    task: Task
    verdict: TaskVerdict
    runs: list[Run]
    plans: list[P.Plan]
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task.id,
            "name": self.task.name,
            "verdict": self.verdict.verdict,
            "flags": [f.to_json() for f in self.verdict.flags],
            "summary": self.verdict.summary,
            "skipped": self.skipped,
            "notes": self.notes,
            "plans": [
                {
                    "name": p.name,
                    "agent": p.agent,
                    "steps": list(p.steps),
                    "answer": p.answer,
                    **({"source": p.source} if p.source else {}),
                    **({"removed": p.removed} if p.removed is not None else {}),
                }
                for p in self.plans
                if not p.random_seed  # a random plan's steps are in its runs
            ],
            "runs": [r.to_json() for r in self.runs],
            "seconds": round(self.seconds, 3),
        }


async def all_or_none(jobs: list[asyncio.Future]) -> list:
    """Every job's result; when one fails or the caller is cancelled, the others are cancelled
    and waited for to their end (a run's end terminates its box) before it raises. ``gather``
    would return at once on a cancellation, while the runs are still terminating their boxes."""
    try:
        return list(await asyncio.gather(*jobs))
    except BaseException:
        for job in jobs:
            job.cancel()
        while not all(job.done() for job in jobs):
            try:
                await asyncio.wait(jobs)  # unlike gather, never cancels what it waits for
            except asyncio.CancelledError:
                continue  # a second signal: the terminates are under way, each bounded
        raise


class Audit:
    """Audits tasks on ``genv``; ``on_task(result)`` is called as each task ends."""

    def __init__(
        self,
        config: AuditConfig,
        genv: GenvClient,
        concurrency: int,
        *,
        successes: Successes | None = None,
        on_task: Callable[[TaskResult], None] = lambda r: None,
    ):
        self.config = config
        self.genv = genv
        self.runner = Runner(genv, concurrency, config.random_actions)
        self.successes = successes
        self.on_task = on_task
        self.results: list[TaskResult] = []

    async def run(self, tasks: list[Task]) -> list[TaskResult]:
        """Every task's result, in the tasks' order; cancellation propagates once every run
        has closed its box (the results so far stay in ``results``)."""
        await all_or_none([asyncio.ensure_future(self.audit_task(t)) for t in tasks])
        order = {t.id: i for i, t in enumerate(tasks)}
        return sorted(self.results, key=lambda r: order[r.task.id])

    async def audit_task(self, task: Task) -> TaskResult:
        detail = await self._detail(task)
        todo = await self.plans(task, detail)
        runs = await self._run_all(task, todo.plans)
        replays = [r for r in runs if r.agent == "replay" and r.repeat == 0 and r.ok]
        for replay in replays:
            plan = next(p for p in todo.plans if p.name == replay.plan)
            extra = P.ablations(plan, replay.changed_steps(), self.config.max_ablations)
            answer = P.answer_only(plan) if replay.changed_steps() else None
            extra += [answer] if answer is not None else []
            todo.plans += extra
            runs += await self._run_all(task, extra)
        self._note_missing_routes(runs, todo.skipped)
        result = TaskResult(task, judge(runs), runs, todo.plans, todo.skipped, todo.notes)
        # What the task cost: its runs' box time (its runs wait on the bound with the others').
        result.seconds = sum(r.seconds for r in runs)
        self.results.append(result)
        self.on_task(result)
        return result

    async def _run_all(self, task: Task, plans: list[P.Plan]) -> list[Run]:
        return await all_or_none(
            [
                asyncio.ensure_future(self.runner.run(task.id, plan, repeat))
                for plan in plans
                for repeat in range(self.config.repeats)
            ]
        )

    async def _detail(self, task: Task) -> dict[str, Any]:
        """The task's full object from the gym (what it reads, its solution), else its own."""
        try:
            return {**task.raw, **await self.genv.get_task(task.id)}
        except GymError as exc:
            log.info(
                "task %s: no detail from the gym (%s); using the task's own object", task.id, exc
            )
            return dict(task.raw)

    async def plans(self, task: Task, detail: dict[str, Any]) -> P.TaskPlans:
        cfg, out = self.config, P.TaskPlans()
        agents = set(cfg.agents)
        if "stop" in agents:
            out.plans.append(P.stop())
        if "wait" in agents:
            out.plans.append(P.wait(cfg.wait_steps))
        if "random" in agents:
            out.plans += P.random_plans(task.id, cfg.seed, cfg.random_sequences)
        if "infeasible" in agents:
            if detail_flag(detail, "reads_answer") is False:
                out.skipped["infeasible"] = "the task reads no answer"
            else:
                answer = detail_flag(detail, "infeasible_answer") or cfg.infeasible_answer
                out.plans.append(P.infeasible(str(answer)))
        if "replay" in agents:
            await self._replays(task, detail, out)
        return out

    async def _replays(self, task: Task, detail: dict[str, Any], out: P.TaskPlans) -> None:
        why = []
        solution = detail.get("solution")
        if isinstance(solution, list) and solution:
            try:
                out.plans.append(P.from_solution(solution))
            except ValueError as exc:
                why.append(f"its solution does not parse: {exc}")
        if self.successes is None:
            why.append("no monitor to read recorded successes from")
        else:
            try:
                stored = await self.successes(task.id)
            except (MonitorError, StoredEpisodeError) as exc:
                stored = []
                why.append(f"the monitor's recorded successes could not be read: {exc}")
            for episode in stored:
                try:
                    out.plans.append(
                        P.from_stored(
                            episode.turns, training=episode.training, rollout=episode.rollout_uuid
                        )
                    )
                except P.ReplayError as exc:
                    why.append(f"recorded success {episode.rollout_uuid}: {exc}")
            if not stored:
                why.append("the warehouse holds no recorded success of it")
        if not any(p.agent == "replay" for p in out.plans):
            out.skipped["replay"] = "; ".join(why) or "nothing to replay"
        else:
            out.notes += [w for w in why if w.startswith("recorded success ")]

    @staticmethod
    def _note_missing_routes(runs: list[Run], skipped: dict[str, str]) -> None:
        for agent in BOX_AGENTS:
            mine = [r for r in runs if r.agent == agent]
            if box_routes_missing(mine):
                skipped[agent] = "the gym serves no box routes (screenshot, actions): " + str(
                    mine[0].error
                )
                runs[:] = [r for r in runs if r.agent != agent]

    @property
    def live(self) -> set[str]:
        return self.runner.live

    def executions(self) -> dict[str, int]:
        """Boxes opened, terminated and open now; terminates that failed for good."""
        stats = self.genv.stats
        return {
            "created": self.runner.created,
            "terminated": int(stats["terminated"]),
            "terminate_failed": int(stats["terminate_failed"]),
            "open": len(self.runner.live),
        }
