"""The lines one of our loggers emits, for tests (``cua_rl.logs`` loggers do not propagate to
pytest's capture)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    """``with LogLines(logger) as log: ...`` then ``log.lines``: the messages, formatted."""

    def __init__(self, logger: logging.Logger, level: int = logging.INFO):
        super().__init__(level)
        self.logger, self.lines = logger, []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogLines:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
