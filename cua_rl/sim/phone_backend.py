"""The simulated phone behind the local gym: its task catalogue and one ``Phone`` per execution.

Everything is in-process Python; rendering (milliseconds of CPU) runs in a thread so the gym's
event loop keeps serving other executions meanwhile.
"""

from __future__ import annotations

import asyncio

from cua_rl.agent.actions import format_action, parse_action
from cua_rl.sim.phone import DESIGN_H, DESIGN_W, Phone
from cua_rl.sim.phone_render import render_png
from cua_rl.sim.phone_tasks import TASKS, SimTask, initial_state, run_validators
from cua_rl.sim.task_file import load_task_files


class PhoneDevice:
    def __init__(self, task: SimTask, phone: Phone):
        self.task = task
        self.phone = phone
        self.width, self.height = phone.width, phone.height

    async def screenshot(self) -> bytes:
        return await asyncio.to_thread(render_png, self.phone)

    async def act(self, name: str, args: dict) -> str | None:
        return self.phone.act(name, args)

    async def evaluate(self, answer_text: str | None) -> dict:
        return run_validators(self.task, self.phone.state, answer_text)

    def label(self) -> str:
        return self.phone.state.screen

    async def state_key(self) -> str:
        return self.phone.state_key()

    async def close(self) -> None:
        """Nothing to release: the phone is a plain object."""


class PhoneBackend:
    kind = "phone"

    def __init__(
        self,
        width: int = 360,
        height: int = 640,
        clock: str = "fixed",
        task_files: list[str] | None = None,
    ):
        self.width, self.height, self.clock = width, height, clock
        # The built-in tasks, then those of the task files (cua_rl/sim/task_file.py).
        self.tasks = TASKS + load_task_files(list(task_files or ()), TASKS)
        self.by_id = {t.task_id: t for t in self.tasks}

    async def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def entries(self) -> list[dict]:
        return [_entry(t) for t in self.tasks]

    def detail(self, task_id: str) -> dict | None:
        t = self.by_id.get(task_id)
        if t is None:
            return None
        # The detail is richer than the list entry, as the real server's is.
        return {
            **_entry(t),
            "instruction": t.description,
            "meta": {
                "id": t.task_id,
                "number": t.number,
                "displayName": t.name.replace("_", " ").title(),
                "description": t.description,
            },
            "env_config": {
                "type": "sim-phone",
                "width": self.width,
                "height": self.height,
                "start_screen": "home",
            },
            "evaluation": {
                "validators": [{"id": v.id, "weight": v.weight} for v in t.validators],
                # Whether a final answer counts (the audit's claim-infeasible agent needs one).
                "reads_answer": t.reads_answer,
            },
            "seed_id": f"{t.name}-seed",
            # The known solution, in the agent's action language, on this screen's pixels.
            **({"solution": self.solution(t)} if t.solution else {}),
        }

    def solution(self, task: SimTask) -> list[str]:
        """``task.solution`` (written for the 360x640 design grid) scaled to this screen."""
        sx, sy = self.width / DESIGN_W, self.height / DESIGN_H
        out = []
        for call in task.solution:
            action = parse_action(call)
            for key, value in action.params.items():
                if key[0] in "xy" and isinstance(value, int):
                    action.params[key] = min(
                        round(value * (sx if key[0] == "x" else sy)),
                        (self.width if key[0] == "x" else self.height) - 1,
                    )
            out.append(format_action(action))
        return out

    async def open(self, task_id: str, seed: int) -> PhoneDevice:
        task = self.by_id[task_id]
        phone = Phone(initial_state(task, seed), self.width, self.height, self.clock)
        return PhoneDevice(task, phone)


def _entry(t: SimTask) -> dict:
    return {
        "task_id": t.task_id,
        "name": t.name,
        "task_number": t.number,
        "description": t.description,
        "tags": [t.difficulty, t.app],
    }
