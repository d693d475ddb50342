"""Loggers that keep working inside AReaL's processes.

AReaL's ``areal.utils.logging.getLogger`` replaces the root logger and the logger manager every
time it creates a logger, so a module logger of ours would end up under a root with no handler
(INFO lost, WARNING printed bare by logging's last-resort handler). ``get_logger`` gives each of
our loggers its own stderr handler and stops propagation, so the lines reach the trainer's and
the workers' logs (AReaL tees worker stderr into ``logs/.../<role>.log``) whatever AReaL does to
the root. Level: ``$CUA_RL_LOG_LEVEL`` (default INFO).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Ours, held here: AReaL's replacement manager does not list them.
_LOGGERS: list[logging.Logger] = []


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(getattr(h, "_cua_rl", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._cua_rl = True  # marks ours, so a re-import adds no second handler
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(os.environ.get("CUA_RL_LOG_LEVEL", "INFO").upper())
        _LOGGERS.append(logger)
    return logger


@contextlib.contextmanager
def warnings_only():
    """INFO and DEBUG records kept off every handler (the root's and each of ours) meanwhile:
    for a report that is its own lines (``--check``'s table)."""

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING

    handlers = {h for lg in [logging.root, *_LOGGERS] for h in lg.handlers}
    for handler in handlers:
        handler.addFilter(keep)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(keep)
