"""The simulated phone behind the local gym: its task catalogue and one ``Phone`` per execution.

Everything is in-process Python; rendering (milliseconds of CPU) runs in a thread so the gym's
event loop keeps serving other executions meanwhile.
"""

from __future__ import annotations

import asyncio

from cua_rl.sim.phone import Phone
from cua_rl.sim.phone_render import render_png
from cua_rl.sim.phone_tasks import TASKS, TASKS_BY_ID, SimTask, initial_state, run_validators


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

    def __init__(self, width: int = 360, height: int = 640, clock: str = "fixed"):
        self.width, self.height, self.clock = width, height, clock

    async def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def entries(self) -> list[dict]:
        return [_entry(t) for t in TASKS]

    def detail(self, task_id: str) -> dict | None:
        t = TASKS_BY_ID.get(task_id)
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
            "evaluation": {"validators": [{"id": v.id, "weight": v.weight} for v in t.validators]},
            "seed_id": f"{t.name}-seed",
        }

    async def open(self, task_id: str, seed: int) -> PhoneDevice:
        task = TASKS_BY_ID[task_id]
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
