"""The rejection watch: outcome files written by workers, read by the controller's thread."""

from __future__ import annotations

import json
import threading

import pytest

from cua_rl.app.failfast import (
    FailFastConfig,
    RejectionWatch,
    advice_for,
    systematic_reason,
)
from cua_rl.errors import ConfigError
from cua_rl.rollout.outcomes import OutcomeLog


def test_only_a_full_window_of_one_reason_trips():
    rej = (False, "missing_tokens")
    assert systematic_reason([rej] * 3, 4) is None
    assert systematic_reason([rej] * 4, 4) == "missing_tokens"
    assert systematic_reason([(True, None)] + [rej] * 4, 4) == "missing_tokens"
    assert systematic_reason([rej] * 3 + [(True, None)], 4) is None
    assert systematic_reason([rej, rej, (False, "gym_error"), rej], 4) is None
    assert systematic_reason([rej] * 10, 0) is None  # 0 turns the check off


def test_watch_reads_every_worker_s_file_in_time_order(tmp_path, monkeypatch):
    a, b = OutcomeLog(tmp_path), OutcomeLog(tmp_path)
    b.path = tmp_path / "outcomes-other-2.jsonl"  # a second worker process
    watch = RejectionWatch(tmp_path, FailFastConfig(window=4), on_trip=lambda *_: None)
    a.record(accepted=True, reason=None, phase="train")
    for log in (a, b, a):
        log.record(accepted=False, reason="gym_error", phase="train")
    assert watch.poll() is None  # 3 rejections after an acceptance: not yet
    # A writer half way through a line: the fragment waits for the next poll.
    with open(b.path, "a") as f:
        f.write(json.dumps({"t": 1e12, "ok": False, "reason": "gym_error"})[:10])
    assert watch.poll() is None
    with open(b.path, "a") as f:
        f.write(json.dumps({"t": 1e12, "ok": False, "reason": "gym_error"})[10:] + "\n")
    assert watch.poll() == "gym_error"


def test_watch_thread_calls_back_once(tmp_path):
    tripped = threading.Event()
    seen = []
    watch = RejectionWatch(
        tmp_path,
        FailFastConfig(window=2, poll_s=0.05),
        on_trip=lambda reason, window: (seen.append((reason, window)), tripped.set()),
    ).start()
    log = OutcomeLog(tmp_path)
    for _ in range(3):
        log.record(accepted=False, reason="agent_model_error", phase="train")
    assert tripped.wait(5)
    watch.stop()
    assert seen == [("agent_model_error", 2)]
    assert watch.tripped == "agent_model_error"


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


def test_unwritable_folder_costs_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    OutcomeLog(blocker / "sub").record(accepted=False, reason="x", phase="train")  # no raise
