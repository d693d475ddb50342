"""Runs plans on fresh boxes through the gym: bounded, every box terminated, nothing lost.

Each run is one execution opened with ``GenvClient.execution`` (terminated on every exit,
cancellation included, shielded and bounded), its plan's steps on the gym's box routes
(screenshots, actions) and one evaluation. A semaphore bounds the boxes open at once (the
rollout's ``max_concurrent_rollouts`` unless ``audit.concurrency`` says otherwise); ``live``
holds the executions open right now, so an interrupted audit can say that none is left. A gym
failure ends that run only, recorded with its message; it never passes for a verdict.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cua_rl.audit import plans as P
from cua_rl.audit.state import UNKNOWN, action_effect, episode_effect, rewarded
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import GymError


@dataclass
class Run:
    """One plan's run on one box."""

    agent: str
    plan: str
    repeat: int
    score: float | None = None
    success: bool | None = None
    rewarded: bool = False
    effect: str = UNKNOWN
    effects: list[str] = field(default_factory=list)  # per step (a screenshot: none)
    validators: list[dict] = field(default_factory=list)  # id, passed, message
    error: str | None = None
    execution_id: str = ""
    seconds: float = 0.0
    plan_steps: list[dict] | None = None  # a random plan's steps, as drawn for the screen

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def outcome(self) -> tuple:
        """What two runs of one plan must agree on."""
        return (self.score, self.success)

    def changed_steps(self) -> list[int]:
        return [i for i, e in enumerate(self.effects) if e == "changed"]

    def to_json(self) -> dict:
        return asdict(self)


class Runner:
    """Plays plans on the gym ``genv`` with at most ``concurrency`` boxes open at once."""

    def __init__(self, genv: GenvClient, concurrency: int, random_actions: int):
        self.genv = genv
        self.gate = asyncio.Semaphore(concurrency)
        self.random_actions = random_actions
        self.live: set[str] = set()
        self.created = 0

    async def run(self, task_id: str, plan: P.Plan, repeat: int) -> Run:
        run = Run(plan.agent, plan.name, repeat)
        async with self.gate:
            t0 = time.monotonic()
            try:
                await self._play(task_id, plan, run)
            except GymError as exc:
                run.error = str(exc)
            finally:
                run.seconds = round(time.monotonic() - t0, 3)
        return run

    async def _play(self, task_id: str, plan: P.Plan, run: Run) -> None:
        try:
            async with self.genv.execution(task_id) as box:
                self.created += 1
                self.live.add(box.execution_id)
                run.execution_id = box.execution_id
                result = await self._steps(box, plan, run)
        finally:
            # The scope has terminated the box by now (or counted that it could not:
            # ``genv.stats["terminate_failed"]``).
            self.live.discard(run.execution_id)
        run.effect = episode_effect(run.effects)
        run.score, run.success = result.score, result.success
        run.rewarded = rewarded(result.score, result.success)
        run.validators = [
            {"id": v.id, "passed": v.passed, "message": v.message} for v in result.validators
        ]

    async def _steps(self, box, plan: P.Plan, run: Run):
        """The plan's steps on the open box, then its evaluation."""
        if plan.random_seed:
            shot = await self.genv.screenshot(box.execution_id)
            plan = plan.with_screen(int(shot["width"]), int(shot["height"]), self.random_actions)
            run.plan_steps = list(plan.steps)
        for step in plan.steps:
            if step.get("screenshot"):
                await self.genv.screenshot(box.execution_id)
                continue
            answer = await self.genv.act(box.execution_id, step)
            run.effects.append(action_effect(step.get("name"), answer))
        return await box.evaluate(answer_text=plan.answer)


def box_routes_missing(runs: list[Run]) -> bool:
    """Whether every run failed because the gym serves no box routes (screenshot / actions)."""
    return bool(runs) and all(
        r.error is not None
        and " answered 404" in r.error
        and ("gym screenshot " in r.error or "gym action " in r.error)
        for r in runs
    )


def detail_flag(detail: Mapping[str, Any], key: str) -> Any:
    """A task detail's ``evaluation.<key>`` (None when absent)."""
    evaluation = detail.get("evaluation")
    return evaluation.get(key) if isinstance(evaluation, Mapping) else None
