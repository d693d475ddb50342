"""The episode's extension points on the real local stack (sim gym, local agent, vLLM CPU with a
tiny Qwen2-VL, the gateway, a real monitor on SQLite): an observer cannot change an episode, and
a hook that raises ends its episode as a counted rejection naming the hook and the exception,
never escaping to AReaL (whose executor would log it, draw another task and spin)."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest
import torch
from areal.infra import workflow_context

from cua_rl.gateway import Sampling
from cua_rl.rollout import observers
from cua_rl.rollout.settings import PauseConfig
from cua_rl.rollout.workflow import CUAAgentWorkflow
from tests.app import test_workflow as stack
from tests.app import workflows
from tests.app.test_workflow import (
    ROW_KEYS,
    _engine,
    _open_executions,
    _rollout_stats,
    _set_faults,
    _settings,
)

# The workflow tests' services, shared: the local gym and agent, a monitor per test, a task.
gym, agent, monitor, easy_task = stack.gym, stack.agent, stack.monitor, stack.easy_task

pytestmark = pytest.mark.slow

# What an accepted episode emits, in order: every event kind, the box's three states.
EMITTED = [
    "started",
    "box_changed",  # creating
    "box_changed",  # running
    "agent_ran",
    "box_changed",  # terminated
    "capture_closed",
    "evaluated",
    "converted",
    "ended",
]
KINDS = set(EMITTED)


class Lines(logging.Handler):
    """The log lines of one of our module loggers (they do not propagate, and AReaL replaces
    logging's manager: the module's own object, not ``getLogger``'s: cua_rl/logs.py)."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger = logger
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def _greedy(settings):
    settings.sampling = Sampling(greedy=True, max_new_tokens=24)
    return settings


async def _episodes(wf, engine, task, n: int) -> list:
    try:
        return [await wf.arun_episode(engine, dict(task)) for _ in range(n)]
    finally:
        await wf.aclose()


def _rollouts(db_path) -> list[tuple]:
    db = sqlite3.connect(db_path)
    try:
        return db.execute(
            "SELECT r.status, r.reward, r.task_success, COUNT(t.id), "
            "(SELECT COUNT(*) FROM validation v WHERE v.rollout_id = r.id), "
            "(SELECT e.status FROM environment e WHERE e.rollout_id = r.id) "
            "FROM rollout r LEFT JOIN turn t ON t.rollout_id = r.id GROUP BY r.id ORDER BY r.id"
        ).fetchall()
    finally:
        db.close()


async def test_an_observer_raising_at_every_event_changes_nothing_and_is_counted(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task, tmp_path
):
    """Greedy sampling on one task: the library's workflow gives a reference episode; then the
    same workflow with an observer first in the list that raises at every event kind runs two
    episodes. Each gives the same row, the same stats and the same monitor records (the
    observers after the raising one are all told), and the raising one is counted at every event
    and logged once per event kind, not once per episode."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    reference_settings = _greedy(_settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor))
    reference_settings.outcome_dir = str(tmp_path / "reference")
    engine = _engine(vllm_server)  # an engine per training: each has its runtime
    (reference,) = await _episodes(CUAAgentWorkflow(reference_settings), engine, easy_task, 1)
    assert reference is not None, _rollout_stats()
    reference_stats = _rollout_stats()
    assert not any("observer_errors" in k for k in reference_stats), reference_stats

    settings = _greedy(_settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor))
    settings.outcome_dir = str(tmp_path / "raising")
    wf = workflows.WithRaisingObserver(settings)
    with Lines(observers.log) as lines:
        rows = await _episodes(wf, _engine(vllm_server), easy_task, 2)
    stats = _rollout_stats()

    assert wf.raising.kinds == [*EMITTED, *EMITTED], wf.raising.kinds  # every event, twice
    for row in rows:
        assert row is not None and set(row) == ROW_KEYS
        for key in ROW_KEYS - {"multi_modal_input", "episode_id", "logprobs"}:
            assert torch.equal(row[key], reference[key]), key
        assert torch.allclose(row["logprobs"], reference["logprobs"], atol=1e-4)
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(
                row["multi_modal_input"][0][key], reference["multi_modal_input"][0][key]
            )
    # Counted at every event of both episodes; the episodes' own stats as the reference's.
    assert stats["rollout/cua/observer_errors/raising"] == 1.0
    assert stats["rollout/cua/observer_errors/raising__count"] == 2 * len(EMITTED), stats
    assert stats["rollout/cua/accepted"] == reference_stats["rollout/cua/accepted"] == 1.0
    assert stats["rollout/cua/reward"] == reference_stats["rollout/cua/reward"]
    assert stats["rollout/cua/trained_tokens"] == reference_stats["rollout/cua/trained_tokens"]
    # Logged with its traceback once per event kind, naming the observer and the kind.
    logged = [r for r in lines.records if r.levelno >= logging.ERROR]
    assert len(logged) == len(KINDS), [r.getMessage() for r in logged]
    assert {r.getMessage().split(" raised at ")[1].split()[0] for r in logged} == KINDS
    assert all(r.exc_info and "observer raising" in r.getMessage() for r in logged)
    # The monitor (told after the raising observer) recorded all three alike; so did the outcomes.
    first, *others = _rollouts(monitor.db_path)
    assert first[0] == "completed" and first[3] >= 1 and first[4] == 1, first
    assert others == [first, first], (first, others)
    outcomes = [
        [json.loads(x)["ok"] for f in (tmp_path / d).iterdir() for x in f.read_text().splitlines()]
        for d in ("reference", "raising")
    ]
    assert outcomes == [[True], [True, True]], outcomes
    assert await _open_executions(gym) == []


async def test_a_rejected_episode_stays_rejected_with_a_raising_observer(
    gym, agent, vllm_server, tiny_vl_model_dir, easy_task
):
    """The gym refuses every create: the episode is rejected gym_error as it would be, the pause
    observer after the raising one still opens the gym's pause, and the errors are counted."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir)
    settings.pause = PauseConfig(probe_initial_s=60, probe_max_s=60)  # no probe in the test
    wf = workflows.WithRaisingObserver(settings)
    await _set_faults(gym, create={"fail_rate": 1.0})
    try:
        row = await wf.arun_episode(_engine(vllm_server), dict(easy_task))
        paused = set(wf.runtime.service_pauses().open)
    finally:
        await wf.aclose()
        await _set_faults(gym)
    assert row is None and paused == {"gym"}
    stats = _rollout_stats()
    assert stats["rollout/cua/rejected/gym_error"] == 1.0, stats
    # Started, creating, error, the capture, the end: what a refused create emits.
    assert wf.raising.kinds == ["started", "box_changed", "box_changed", "capture_closed", "ended"]
    assert stats["rollout/cua/observer_errors/raising__count"] == len(wf.raising.kinds), stats
    assert await _open_executions(gym) == []


HOOKS = [
    (workflows.BrokenRunSpec, "build_run_spec", "KeyError: 'instruction'"),
    (workflows.BrokenAgent, "run_agent", "RuntimeError: the agent's bug"),
    (workflows.BrokenReward, "compute_reward", "ZeroDivisionError: the reward's bug"),
    (workflows.BrokenRows, "build_rows", "ValueError: the row builder's bug"),
    (
        workflows.RewardOfTheWrongType,
        "compute_reward",
        "TypeError: returned a float, not a RewardOutcome",
    ),
    (workflows.BrokenObservers, "observers", "AttributeError: the observer list's bug"),
]


@pytest.mark.parametrize(("cls", "hook", "error"), HOOKS, ids=[c.__name__ for c, *_ in HOOKS])
async def test_a_hook_that_raises_rejects_its_episode_naming_hook_and_exception(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task, tmp_path, cls, hook, error
):
    """Nothing escapes ``arun_episode``: the episode ends None, counted ``hook_<hook>``, its
    outcome line and its monitor rollout name the exception and the hook, its box is gone."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    settings = _settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor)
    settings.outcome_dir = str(tmp_path / "outcomes")
    wf = cls(settings)
    where = f"{cls.__module__}.{cls.__qualname__}.{hook}"
    try:
        rows = [await wf.arun_episode(_engine(vllm_server), dict(easy_task)) for _ in range(2)]
    finally:
        await wf.aclose()
    assert rows == [None, None]
    stats = _rollout_stats()
    assert stats[f"rollout/cua/rejected/hook_{hook}"] == 1.0, stats
    assert stats[f"rollout/cua/rejected/hook_{hook}__count"] == 2, stats
    assert stats["rollout/cua/accepted"] == 0.0
    lines = [
        json.loads(x) for f in (tmp_path / "outcomes").iterdir() for x in f.read_text().splitlines()
    ]
    assert [(x["ok"], x["reason"]) for x in lines] == [(False, f"hook_{hook}")] * 2, lines
    assert all(x["detail"] == f"{error} (raised by {where})" for x in lines), lines
    db = sqlite3.connect(monitor.db_path)
    recorded = db.execute("SELECT status, status_message, error_message FROM rollout").fetchall()
    db.close()
    assert [(s, m) for s, m, _ in recorded] == [("failed", f"hook_{hook}")] * 2, recorded
    assert all(error in e and where in e for *_, e in recorded), recorded
    assert await _open_executions(gym) == []


async def test_a_subclass_that_overrides_only_the_reward_credits_its_rows(
    gym, agent, vllm_server, tiny_vl_model_dir, monitor, easy_task
):
    """One method in one file: every row, the step's stats and the monitor carry its reward."""
    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    _rollout_stats()
    wf = workflows.RewardPlusBonus(_settings(gym, agent, vllm_server, tiny_vl_model_dir, monitor))
    (row,) = await _episodes(wf, _engine(vllm_server), easy_task, 1)
    assert row is not None, _rollout_stats()
    reward = float(row["rewards"][0])
    assert reward >= workflows.BONUS - 1.0 and (row["rewards"] == reward).all()
    assert _rollout_stats()["rollout/cua/reward"] == pytest.approx(reward)
    ((status, recorded, *_),) = _rollouts(monitor.db_path)
    assert status == "completed" and recorded == pytest.approx(reward)
