"""The sampler inside AReaL's train data loader: lazy draws from the monitor's outcomes, the
decision log, per-step stats, and the state a recover checkpoint carries."""

from __future__ import annotations

import json

import pytest
from areal.utils.data import cycle_dataloader
from torchdata.stateful_dataloader import StatefulDataLoader

from cua_rl.curriculum.outcomes import MonitorOutcomes
from cua_rl.curriculum.sampler import CurriculumSampler
from cua_rl.curriculum.selector import CurriculumConfig, TaskEstimate, select_batch
from cua_rl.errors import ConfigError, MonitorError

TASKS = [f"task-{i}" for i in range(10)]
ROWS = [{"task_id": t, "instruction": f"do {t}"} for t in TASKS]


class CountingSource:
    """The real monitor source, counting reads; ``down`` makes reads fail as an outage would."""

    def __init__(self, inner: MonitorOutcomes):
        self.inner = inner
        self.reads = 0
        self.down = False

    def fetch(self):
        self.reads += 1
        if self.down:
            raise MonitorError("monitor unreachable (injected)")
        return self.inner.fetch()


def _sampler(monitor, tmp_path, *, run="run", seed=5, batch_size=3, **config):
    source = CountingSource(MonitorOutcomes(monitor.url, run))
    return CurriculumSampler(
        TASKS,
        config=CurriculumConfig(kind="ucb", **config),
        source=source,
        batch_size=batch_size,
        group_size=2,
        seed=seed,
        log_path=tmp_path / "logs" / "curriculum.jsonl",
    )


def _loader(sampler: CurriculumSampler) -> StatefulDataLoader:
    # What CurriculumPPOTrainer builds for AReaL's controller.
    return StatefulDataLoader(
        ROWS, batch_size=sampler.batch_size, sampler=sampler, num_workers=0, collate_fn=lambda x: x
    )


def _log(tmp_path) -> list[dict]:
    path = tmp_path / "logs" / "curriculum.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _recompute(draw: dict, config: CurriculumConfig) -> list[int]:
    """The batch the selector gives for the estimates a draw logged."""
    est = [
        TaskEstimate(*draw["estimates"][t]) if t in draw["estimates"] else TaskEstimate()
        for t in TASKS
    ]
    sel = select_batch(
        est,
        len(draw["indices"]),
        group_size=2,
        config=config,
        seed=draw["seed"],
        batch_index=draw["batch"],
    )
    return list(sel.indices)


def test_each_batch_is_drawn_when_asked_from_the_outcomes_recorded_by_then(monitor, tmp_path):
    sampler = _sampler(monitor, tmp_path)
    rows = cycle_dataloader(_loader(sampler))
    assert sampler.source.reads == 0  # nothing is drawn before the trainer asks

    first = next(rows)
    assert sampler.source.reads == 1 and len({r["task_id"] for r in first}) == 3
    # The policy turns out to be half right on task-7 and settled on every other task.
    monitor.record(
        "run",
        [
            {"task": "task-7", "step": 1, "reward": float(i % 2), "success": i % 2 == 1}
            for i in range(20)
        ]
        + [
            {"task": t, "step": 1, "reward": float(i % 2), "success": i % 2 == 1}
            for i, t in enumerate(TASKS)
            if t != "task-7"
            for _ in range(20)
        ],
    )
    later = [next(rows) for _ in range(6)]
    assert sampler.source.reads == 7
    # task-7 is in (almost) every batch drawn after its outcomes were recorded.
    with_7 = sum("task-7" in {r["task_id"] for r in batch} for batch in later)
    assert with_7 >= 5, later

    draws = [r for r in _log(tmp_path) if r["event"] == "draw"]
    assert [d["batch"] for d in draws] == list(range(7))
    assert draws[0]["estimates"] == {} and draws[0]["never_tried"] == 10
    assert draws[1]["estimates"]["task-7"][:2] == [20, 10.0]
    assert draws[1]["never_tried"] == 0
    for d, batch in zip(draws, [first, *later], strict=True):
        assert d["chosen"] == [r["task_id"] for r in batch]
        assert _recompute(d, sampler.config) == d["indices"]


def test_step_stats_describe_the_draws_since_the_last_step(monitor, tmp_path):
    monitor.record(
        "run",
        [{"task": "task-0", "step": 1, "reward": 1.0, "success": True}] * 3
        + [{"task": "task-1", "step": 1, "reward": 0.0, "success": False}],
    )
    sampler = _sampler(monitor, tmp_path, floor=0.0, batch_size=2)
    batch = [sampler.next_index() for _ in range(2)]
    stats = sampler.pop_step_stats()
    # Beta(1, 1) posterior means: task-0 3/3 -> 4/5, task-1 0/1 -> 1/3, untried 1/2.
    posterior = {0: 4 / 5, 1: 1 / 3}
    expected = sum(posterior.get(i, 0.5) for i in batch) / 2
    assert stats["curriculum/sampled_success"] == pytest.approx(expected)
    assert stats["curriculum/never_tried"] == 8
    assert stats["curriculum/never_tried_share"] == pytest.approx(0.8)
    assert stats["curriculum/draws"] == 1 and stats["curriculum/recorded_tries"] == 4
    assert stats["curriculum/floor_share"] == 0.0
    # A step that drew nothing still reports what is known.
    quiet = sampler.pop_step_stats()
    assert quiet["curriculum/draws"] == 0 and quiet["curriculum/never_tried"] == 8
    assert "curriculum/sampled_success" not in quiet


def test_a_monitor_outage_keeps_the_last_outcomes_and_is_counted(monitor, tmp_path):
    monitor.record("run", [{"task": "task-4", "step": 1, "reward": 1.0, "success": True}])
    sampler = _sampler(monitor, tmp_path)
    sampler.next_index()
    sampler.pending.clear()
    sampler.source.down = True
    sampler.next_index()
    stats = sampler.pop_step_stats()
    assert stats["curriculum/fetch_errors"] == 1
    # The second draw still used task-4's outcome.
    second = [r for r in _log(tmp_path) if r["event"] == "draw"][1]
    assert "injected" in second["fetch_error"] and second["estimates"]["task-4"][0] == 1
    assert stats["curriculum/never_tried"] == 9


@pytest.mark.parametrize("pulled", [2, 5])  # a restart at an epoch's end (3 batches) or inside
def test_a_resumed_loader_goes_on_with_the_same_state_and_batches(monitor, tmp_path, pulled):
    monitor.record(
        "run",
        [
            {"task": f"task-{i}", "step": 1, "reward": float(i % 3 == 0), "success": i % 3 == 0}
            for i in range(6)
        ],
    )
    sampler = _sampler(monitor, tmp_path)
    loader = _loader(sampler)
    rows = cycle_dataloader(loader)
    for _ in range(pulled):
        next(rows)
    checkpoint = loader.state_dict()  # what AReaL's RecoverHandler pickles
    before = sampler.state()
    expected = [[r["task_id"] for r in next(rows)] for _ in range(4)]

    # A new process: a new sampler and loader, the checkpoint loaded, as PPOTrainer does.
    resumed = _sampler(monitor, tmp_path)
    new_loader = _loader(resumed)
    new_loader.load_state_dict(checkpoint)
    new_rows = cycle_dataloader(new_loader)
    got = [[r["task_id"] for r in next(new_rows)]]
    assert resumed.state() == {**before, "batches_drawn": before["batches_drawn"] + 1}
    got += [[r["task_id"] for r in next(new_rows)] for _ in range(3)]
    assert got == expected

    events = [r["event"] for r in _log(tmp_path)]
    assert events.count("state_saved") == 1 and events.count("state_loaded") == 1
    loaded = next(r for r in _log(tmp_path) if r["event"] == "state_loaded")
    assert loaded["state"] == before


def test_restoring_state_of_another_task_set_or_format(monitor, tmp_path, caplog):
    sampler = _sampler(monitor, tmp_path)
    sampler.next_index()
    state = sampler.state()
    assert state["pending"]  # two of the batch's three indices not handed out yet
    other = CurriculumSampler(
        TASKS[:-1],
        config=CurriculumConfig(kind="ucb"),
        source=sampler.source,
        batch_size=3,
        group_size=2,
        seed=5,
    )
    other.load_state_dict(state)
    assert other.batches_drawn == 1 and other.pending == []
    with pytest.raises(ConfigError, match="format"):
        other.load_state_dict({**state, "format": 99})


def test_bad_construction_is_refused(monitor, tmp_path):
    with pytest.raises(ConfigError, match="between 1 and the number of train tasks"):
        _sampler(monitor, tmp_path, batch_size=11)
    with pytest.raises(ConfigError, match="unique task ids"):
        CurriculumSampler(
            ["a", "a"],
            config=CurriculumConfig(kind="ucb"),
            source=None,
            batch_size=1,
            group_size=2,
            seed=0,
        )
