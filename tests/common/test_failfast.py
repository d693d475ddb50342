"""The rejection watch: outcome files written by workers, read by the controller's thread."""

from __future__ import annotations

import json
import threading

import pytest

from cua_rl.app.failfast import FailFastConfig, RejectionWatch, advice_for
from cua_rl.errors import ConfigError
from cua_rl.rollout.outcomes import OutcomeLog


class Clock:
    """The workers' wall clock, moved by the test."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _watch(tmp_path, window=4, persist_s=60.0):
    clock = Clock()
    log = OutcomeLog(tmp_path, clock=clock)
    watch = RejectionWatch(
        tmp_path, FailFastConfig(window=window, persist_s=persist_s), on_trip=lambda *_: None
    )
    return clock, log, watch


def _reject(log, clock, n, every_s, reason="gym_error"):
    for _ in range(n):
        log.record(accepted=False, reason=reason, phase="train")
        clock.t += every_s


def test_a_burst_shorter_than_persist_s_never_stops_however_many_episodes(tmp_path):
    clock, log, watch = _watch(tmp_path)
    # 500 episodes in flight all rejected within 59 s (a model-server restart): no stop.
    _reject(log, clock, 500, 59.0 / 499)
    assert watch.poll() is None
    clock.t += 3600  # then quiet for an hour: the span is the rejections', not the wall's
    assert watch.poll() is None
    log.record(accepted=True, reason=None, phase="train")
    _reject(log, clock, 10, 5.0)  # a new outage, 45 s: still no stop
    assert watch.poll() is None


def test_a_persistent_rejection_stops_with_its_reason_and_advice(tmp_path):
    clock, log, watch = _watch(tmp_path)
    _reject(log, clock, 6, 10.0, reason="missing_tokens")  # 0 .. 50 s
    assert watch.poll() is None
    _reject(log, clock, 1, 10.0, reason="missing_tokens")  # the 7th at 60 s
    assert watch.poll() == "missing_tokens"
    assert "endpoint.mode=gateway" in advice_for(watch.streak.reason)


def test_persistence_needs_at_least_window_episodes(tmp_path):
    clock, log, watch = _watch(tmp_path, window=4)
    _reject(log, clock, 3, 100.0)  # 200 s of rejections, but 3 episodes
    assert watch.poll() is None
    _reject(log, clock, 1, 1.0)
    assert watch.poll() == "gym_error"


def test_an_accepted_episode_or_another_reason_starts_over(tmp_path):
    clock, log, watch = _watch(tmp_path)
    _reject(log, clock, 5, 10.0)  # 0 .. 40 s
    log.record(accepted=True, reason=None, phase="train")
    _reject(log, clock, 5, 10.0)  # 50 .. 90 s: 40 s since the acceptance
    assert watch.poll() is None
    _reject(log, clock, 3, 10.0, reason="agent_timeout")  # 100 .. 120 s, another reason
    _reject(log, clock, 4, 10.0)  # 130 .. 160 s
    assert watch.poll() is None
    _reject(log, clock, 3, 10.0)  # 170 .. 190 s: 60 s of gym_error since 130 s
    assert watch.poll() == "gym_error"


def test_watch_reads_every_worker_s_file_in_time_order(tmp_path):
    clock = Clock()
    a, b = OutcomeLog(tmp_path, clock=clock), OutcomeLog(tmp_path, clock=clock)
    b.path = tmp_path / "outcomes-other-2.jsonl"  # a second worker process
    watch = RejectionWatch(
        tmp_path, FailFastConfig(window=4, persist_s=60.0), on_trip=lambda *_: None
    )
    a.record(accepted=True, reason=None, phase="train")
    for log in (a, b, a):
        clock.t += 30
        log.record(accepted=False, reason="gym_error", phase="train")
    assert watch.poll() is None  # 3 rejections over 60 s after an acceptance: not yet
    # A writer half way through a line: the fragment waits for the next poll.
    with open(b.path, "a") as f:
        f.write(json.dumps({"t": clock.t + 1, "ok": False, "reason": "gym_error"})[:10])
    assert watch.poll() is None
    with open(b.path, "a") as f:
        f.write(json.dumps({"t": clock.t + 1, "ok": False, "reason": "gym_error"})[10:] + "\n")
    assert watch.poll() == "gym_error"


def test_watch_thread_calls_back_once(tmp_path):
    tripped = threading.Event()
    seen = []
    watch = RejectionWatch(
        tmp_path,
        FailFastConfig(window=2, persist_s=0, poll_s=0.05),
        on_trip=lambda reason, count, detail: (seen.append((reason, count, detail)), tripped.set()),
    )
    log = OutcomeLog(tmp_path)
    for _ in range(3):
        log.record(accepted=False, reason="agent_model_error", phase="train")
    watch.start()  # after the writes: one poll reads all three
    assert tripped.wait(5)
    watch.stop()
    assert seen == [("agent_model_error", 3, "")]
    assert watch.tripped == "agent_model_error"


def test_a_hook_s_rejections_stop_the_run_naming_the_hook_and_its_exception(tmp_path):
    # A workflow hook that raises on every episode (cua_rl/rollout/episode.py): its rejections
    # carry the exception and the hook, and the failfast line quotes the latest.
    from cua_rl.app.signals import SystematicRejection

    clock, log, watch = _watch(tmp_path, window=3, persist_s=0)
    for n in range(3):
        log.record(
            accepted=False,
            reason="hook_compute_reward",
            phase="train",
            detail=f"ZeroDivisionError: division by zero #{n} (raised by my.Workflow.compute_reward)",
        )
    assert watch.poll() == "hook_compute_reward"
    line = str(SystematicRejection(watch.streak.reason, 3, watch.streak.detail))
    assert "'hook_compute_reward'" in line and "compute_reward hook raised" in line, line
    assert "ZeroDivisionError: division by zero #2 (raised by my.Workflow.compute_reward)" in line
    assert "\n" not in line  # the one line the launcher prints
    # Other reasons' advice is unchanged by a detail; an accepted episode clears it.
    assert advice_for("missing_tokens", "x") == advice_for("missing_tokens")
    log.record(accepted=True, reason=None, phase="train")
    watch.poll()
    assert watch.streak.detail == ""


def test_advice_names_a_fix():
    assert "endpoint.mode=gateway" in advice_for("missing_tokens")
    assert "gateway.public_host" in advice_for("gateway_unreachable")
    assert "agent's log" in advice_for("agent_timeout")
    assert "rollout log" in advice_for("something_new")


def test_bad_config_names_its_fix():
    with pytest.raises(ConfigError, match="failfast.window"):
        FailFastConfig(window=-1)
    with pytest.raises(ConfigError, match="poll_s"):
        FailFastConfig(poll_s=0)
    with pytest.raises(ConfigError, match="failfast.persist_s must be >= 0"):
        FailFastConfig(persist_s=-1)


def test_a_check_its_own_concurrency_would_trip_in_seconds_is_refused():
    with pytest.raises(ConfigError, match="failfast.persist_s to at least 60") as info:
        FailFastConfig(window=16, persist_s=5).check_concurrency(32)
    assert "failfast.window above rollout.max_concurrent_rollouts" in str(info.value)
    with pytest.raises(ConfigError, match="unbounded"):
        FailFastConfig(window=16, persist_s=5).check_concurrency(None)
    FailFastConfig(window=16, persist_s=60).check_concurrency(32)
    FailFastConfig(window=33, persist_s=0).check_concurrency(32)  # more than one wave
    FailFastConfig(window=0, persist_s=0).check_concurrency(32)  # off


def test_unwritable_folder_costs_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    OutcomeLog(blocker / "sub").record(accepted=False, reason="x", phase="train")  # no raise
