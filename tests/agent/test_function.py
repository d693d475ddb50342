"""``agent.mode: function`` without services: the callable's path and kind, and the run's events
built from the box's calls and the gateway's captured calls (``run_events``), read back by the
trajectory's event parser as the agent loop's are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cua_rl.agent.function import BoxCall, describe, is_async, load_agent_function, run_events
from cua_rl.agent.spec import summarize_events
from cua_rl.errors import ConfigError
from cua_rl.trajectory.events import event_time, events_to_turns
from tests.agent import agents


def _call(n: int, text: str = "tap(1, 2)") -> SimpleNamespace:
    """A captured call as the gateway keeps it (the fields run_events reads)."""
    return SimpleNamespace(
        response_id=f"chatcmpl-{n}",
        message={"role": "assistant", "content": text},
        finish_reason="stop",
        seconds=0.25,
    )


class _Script:
    """Box calls at given times, each seeing the calls captured so far."""

    def __init__(self):
        self.log: list[BoxCall] = []
        self.calls = 0
        self.t = 100.0

    def ask(self, n: int = 1) -> _Script:
        self.calls += n
        self.t += 1
        return self

    def look(self) -> _Script:
        self.log.append(BoxCall("screenshot", self.calls, self.t, self.t + 0.1))
        self.t += 1
        return self

    def act(self, name: str = "tap", **args) -> _Script:
        action = {"name": name, "args": args or {"x": 1, "y": 2}}
        result = {"ok": True, "error": None}
        self.log.append(BoxCall("act", self.calls, self.t, self.t + 0.2, action, result))
        self.t += 1
        return self

    def events(self, answer=None, reason="finished", errors=()) -> list[dict]:
        calls = [_call(i) for i in range(self.calls)]
        return run_events(self.log, calls, answer, list(errors), reason, 99.0, self.t + 5)


def _shape(events: list[dict]) -> list[tuple]:
    """(step, kind, action name) per event."""
    return [(e["step"], e["type"], (e.get("action") or {}).get("name")) for e in events]


def test_look_ask_act_steps_are_the_loops_steps_with_the_answer_last():
    s = _Script().look().ask().act().look().ask().act("type", text="hi").look().ask()
    events = s.events(answer="done")
    assert _shape(events) == [
        (1, "step_start", None), (1, "model_call", None), (1, "model_output", None),
        (1, "action_executed", "tap"), (1, "step_end", None),
        (2, "step_start", None), (2, "model_call", None), (2, "model_output", None),
        (2, "action_executed", "type"), (2, "step_end", None),
        (3, "step_start", None), (3, "model_call", None), (3, "model_output", None),
        (3, "action_executed", "finished"), (3, "step_end", None),
        (3, "run_end", None),
    ]  # fmt: skip
    times = [event_time(e["ts"]) for e in events]
    assert times == sorted(times) and len(set(times)) == len(times)  # the de-duplication key
    parsed = events_to_turns(events)
    assert parsed.duplicates == 0 and parsed.run_ok is True and parsed.answer == "done"
    assert [(t.step, t.response_id, t.text) for t in parsed.turns] == [
        (1, "chatcmpl-0", "tap(1, 2)"),
        (2, "chatcmpl-1", "tap(1, 2)"),
        (3, "chatcmpl-2", "tap(1, 2)"),
    ]
    # The gym's action bodies recorded as the loop records its parsed calls.
    assert [t.actions[0]["args"] for t in parsed.turns] == [
        {"point": {"x": 1, "y": 2}},
        {"content": "hi"},
        {"content": "done"},
    ]
    assert all(t.action_ok for t in parsed.turns)
    assert summarize_events(events) == ("done", 3, [], "finished")
    # A step spans from its screenshot to its action's end.
    assert parsed.turns[1].started_at == pytest.approx(s.log[2].started)
    assert parsed.turns[1].ended_at == pytest.approx(s.log[3].ended, abs=0.002)


def test_a_reply_without_action_is_a_step_of_its_own():
    events = _Script().look().ask().look().ask().act().events()
    turns = events_to_turns(events).turns
    assert [(t.step, [a["name"] for a in t.actions]) for t in turns] == [(1, []), (2, ["tap"])]


def test_calls_after_an_action_begin_a_step_without_a_screenshot():
    events = _Script().ask().act().ask().act().ask(2).act().act("key", key="enter").events()
    turns = events_to_turns(events).turns
    assert [(t.step, len(t.actions)) for t in turns] == [(1, 1), (2, 1), (3, 0), (3, 2)]
    assert turns[3].actions[1]["args"] == {"key": "enter"}


def test_an_action_before_any_call_and_a_run_without_calls():
    events = _Script().look().act().look().ask().act().events()
    assert [(t.step, len(t.actions)) for t in events_to_turns(events).turns] == [(2, 1)]
    silent = _Script().look().act().events(answer="x", reason="no_model_call")
    assert events_to_turns(silent).turns == []
    assert summarize_events(silent)[0] == "x"
    assert [e["type"] for e in silent][-1] == "run_end"
    nothing = _Script().events(answer=None, reason="deadline", errors=["ran past"])
    assert [(e["type"], e.get("message")) for e in nothing] == [
        ("error", "ran past"),
        ("run_end", None),
    ]
    assert nothing[-1]["ok"] is False


class _AsyncCallable:
    async def __call__(self, episode):
        return None


def test_the_callable_is_loaded_by_path_and_run_as_it_is_written():
    assert load_agent_function("tests.agent.agents:loop_agent_sync") is agents.loop_agent_sync
    assert is_async(agents.loop_agent) and is_async(_AsyncCallable())
    assert not is_async(agents.loop_agent_sync)
    assert "sync, run in a thread" in describe("tests.agent.agents:loop_agent_sync")
    assert "async, run in the episode's task" in describe("tests.agent.agents:loop_agent")
    with pytest.raises(ConfigError, match="module 'no_such_package.agent' cannot be imported"):
        load_agent_function("no_such_package.agent:run")
    with pytest.raises(ConfigError, match="'package.module:callable'"):
        load_agent_function("tests.agent.agents.loop_agent")
