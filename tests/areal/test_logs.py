"""cua_rl's loggers keep printing after AReaL replaces the root logger and the manager."""

from __future__ import annotations

from cua_rl.logs import get_logger


def test_info_lines_survive_areal_logger_resets(capfd, monkeypatch):
    from areal.utils import logging as areal_logging

    monkeypatch.delenv("CUA_RL_LOG_LEVEL", raising=False)
    log = get_logger("cua_rl.test_logs")
    areal_logging.getLogger("cua-rl-test-reset")  # replaces logging's root and manager
    log.info("episode %d rejected", 7)
    assert "INFO cua_rl.test_logs: episode 7 rejected" in capfd.readouterr().err


def test_one_handler_however_often_it_is_asked_for():
    first = get_logger("cua_rl.test_logs_once")
    again = get_logger("cua_rl.test_logs_once")
    assert first is again and len(again.handlers) == 1
