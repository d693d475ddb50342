"""The scripted agents: each is a plan, an action sequence a run plays on a fresh box.

Pure: no I/O. A plan is the same sequence every time it runs, so the runs of one plan can only
differ by the verifier (or the task's own clock): ``repeats`` of it with different rewards are a
flaky verifier. The agents:

- ``stop``: evaluate at once, no action, no answer;
- ``wait``: ``wait_steps`` screenshots (an agent looking at the screen), then stop;
- ``random``: ``random_actions`` random actions of the gym's action space (taps, swipes, typed
  text, keys, back, home), drawn from ``(seed, task, sequence)`` and the screen's size;
- ``infeasible``: stop at once answering that the task cannot be done (tasks that read an
  answer only);
- ``replay``: a known success, as the gym ran it (a recorded success from the warehouse, or the
  task's own solution), and its ``ablation``\\ s: the same with one action removed that changed
  the state when the success was replayed; and, for a success that changed the state and gave a
  final answer, ``answer``: that answer at once, with none of its actions.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rl.agent.actions import Action, parse_action, to_gym_action

SCREENSHOT = {"screenshot": True}
# Keys both of the local gym's devices take.
RANDOM_KEYS = ("enter", "backspace", "space", "tab", "escape")
# The random agent's action mix (name, weight): mostly taps, as an agent's actions are.
RANDOM_MIX = (("tap", 6), ("swipe", 1), ("type", 1), ("key", 1), ("back", 0.5), ("home", 0.5))


@dataclass(frozen=True)
class Plan:
    """One scripted agent's run: ``steps`` (gym action bodies ``{name, args}``, or
    ``SCREENSHOT``) then an evaluation with ``answer``. ``key`` names the plan among its
    agent's (a random sequence's number, a replay's source, an ablation's removed step)."""

    agent: str
    key: str
    steps: tuple[dict, ...] = ()
    answer: str | None = None
    source: str = ""  # where a replay comes from, in words
    removed: int | None = None  # an ablation: the replay step left out
    random_seed: str = ""  # a random plan: its steps follow from this and the screen's size
    replay_key: str = ""  # an ablation: the replay it was made from

    @property
    def name(self) -> str:
        return f"{self.agent}:{self.key}" if self.key else self.agent

    def with_screen(self, width: int, height: int, count: int) -> Plan:
        """A random plan's steps for a ``width`` x ``height`` screen (same seed, same steps)."""
        rng = random.Random(f"{self.random_seed}:{width}x{height}")
        steps = tuple(random_action(rng, width, height) for _ in range(count))
        return Plan(self.agent, self.key, steps, None, random_seed=self.random_seed)


def stop() -> Plan:
    return Plan("stop", "")


def wait(steps: int) -> Plan:
    return Plan("wait", "", (SCREENSHOT,) * steps)


def random_plans(task_id: str, seed: int, sequences: int) -> list[Plan]:
    return [Plan("random", str(i), random_seed=f"{seed}:{task_id}:{i}") for i in range(sequences)]


def infeasible(answer: str) -> Plan:
    return Plan("infeasible", "", answer=answer)


def random_action(rng: random.Random, width: int, height: int) -> dict:
    names, weights = zip(*RANDOM_MIX, strict=True)
    name = rng.choices(names, weights)[0]

    def point() -> tuple[int, int]:
        return rng.randrange(width), rng.randrange(height)

    if name == "tap":
        x, y = point()
        return {"name": "tap", "args": {"x": x, "y": y}}
    if name == "swipe":
        (x1, y1), (x2, y2) = point(), point()
        return {"name": "swipe", "args": {"x1": x1, "y1": y1, "x2": x2, "y2": y2}}
    if name == "type":
        text = "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(1, 6)))
        return {"name": "type", "args": {"text": text}}
    if name == "key":
        return {"name": "key", "args": {"key": rng.choice(RANDOM_KEYS)}}
    return {"name": name, "args": {}}


# ---------------------------------------------------------------------------- replays


class ReplayError(ValueError):
    """A known success cannot be replayed (a step's actions are missing, or unreadable)."""


def from_solution(solution: Sequence[str]) -> Plan:
    """The task's own solution (action-language calls; ``finished("...")`` gives the answer)."""
    steps, answer = _play([parse_action(call) for call in solution])
    return Plan("replay", "solution", steps, answer, source="the task's solution")


def from_stored(turns: Sequence[Mapping[str, Any]], *, training: str, rollout: str) -> Plan:
    """A recorded success (a stored episode's ``turns``: per turn its step and the agent's
    actions, gbox-mini-agent's event form) as the actions the gym ran, in order."""
    by_step: dict[int, list[dict]] = {}
    for turn in turns:
        step = turn.get("step")
        if not isinstance(step, int):
            raise ReplayError(f"a turn without its step: {dict(turn)!r:.120}")
        by_step.setdefault(step, []).extend(a for a in turn.get("actions") or [] if a)
    steps = sorted(by_step)
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
        raise ReplayError(f"the stored episode lacks steps between {steps[0]} and {steps[-1]}")
    actions = [event_action(a) for s in steps for a in by_step[s]]
    played, answer = _play([a for a in actions if a is not None])
    return Plan(
        "replay",
        f"{training}/{rollout}",
        played,
        answer,
        source=f"the recorded success {rollout} of training {training!r}",
    )


def event_action(event: Mapping[str, Any]) -> Action | None:
    """The parsed action an ``action_executed`` event's action ran (its args are
    gbox-mini-agent's: point, startPoint/endPoint, content, key, durationMs); None for a reply
    that did not parse (nothing ran)."""
    name, args = event.get("name"), event.get("args") or {}
    if name == "invalid" or not isinstance(name, str):
        return None
    try:
        if name == "tap":
            return Action("tap", {"x": args["point"]["x"], "y": args["point"]["y"]})
        if name == "swipe":
            start, end = args["startPoint"], args["endPoint"]
            return Action(
                "swipe", {"x1": start["x"], "y1": start["y"], "x2": end["x"], "y2": end["y"]}
            )
        if name in ("type", "finished"):
            return Action(name, {"text": str(args.get("content", ""))})
        if name == "key":
            return Action("key", {"key": args["key"]})
        if name == "wait":
            return Action("wait", {"seconds": float(args.get("durationMs", 1000)) / 1000})
    except (KeyError, TypeError) as exc:
        raise ReplayError(f"action {name!r} with args {dict(args)!r:.120}: {exc}") from None
    return Action(name, dict(args))


def _play(actions: Sequence[Action]) -> tuple[tuple[dict, ...], str | None]:
    """Gym action bodies up to the first ``finished`` (whose text is the answer)."""
    steps = []
    for action in actions:
        if action.name == "finished":
            return tuple(steps), action.params.get("text") or None
        if action.name in ("ask_user", "mcp_call"):
            continue  # never reached the gym
        body = to_gym_action(action)
        if body is not None:
            steps.append(body)
    return tuple(steps), None


def answer_only(replay: Plan) -> Plan | None:
    """The replay's final answer at once, with none of its actions (None: it has no answer)."""
    if not replay.answer:
        return None
    return Plan(
        "answer", replay.key, (), replay.answer, source=replay.source, replay_key=replay.key
    )


def ablations(replay: Plan, changed: Sequence[int], most: int) -> list[Plan]:
    """The replay without one of the steps that changed the state (``changed``: their indices),
    for the last ``most`` of them."""
    chosen = list(changed)[-most:] if most else []
    return [
        Plan(
            "ablation",
            f"{replay.key}-{i}",
            replay.steps[:i] + replay.steps[i + 1 :],
            replay.answer,
            source=replay.source,
            removed=i,
            replay_key=replay.key,
        )
        for i in chosen
    ]


@dataclass
class TaskPlans:
    """Every plan of one task, why an agent has none (``skipped``: agent -> reason), and what
    could not be played though the agent ran (``notes``: a recorded success not replayable)."""

    plans: list[Plan] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
