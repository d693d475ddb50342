"""The package's exception hierarchy.

Everything cua-rl raises on purpose derives from :class:`CuaRlError`, so callers can catch
the package's failures in one clause; stdlib mixins keep ``except ValueError`` working for
configuration problems and ``except RuntimeError`` for service failures.
"""

from __future__ import annotations


class CuaRlError(Exception):
    """Root of every error cua-rl raises on purpose."""


class ConfigError(CuaRlError, ValueError):
    """A configuration value is missing or inconsistent; the message says how to fix it."""


class ConfigProblems(ConfigError):
    """Several configuration problems found in one pass (``--check`` reports them all at once);
    ``problems`` holds each as its own ConfigError."""

    def __init__(self, problems: list[ConfigError]):
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    @classmethod
    def raise_for(cls, problems: list[ConfigError]) -> None:
        """Nothing for none, the problem itself for one, all of them together for more."""
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise cls(problems)


def problem_lines(exc: ConfigError) -> list[str]:
    """One line per problem: what the launcher prints, each after ``config error:``."""
    problems = exc.problems if isinstance(exc, ConfigProblems) else [exc]
    return [" ".join(str(p).split("\n")) for p in problems]


class TaskSelectionError(ConfigError):
    """A task selection is empty or names unknown tasks; the message lists what exists."""


class ServiceError(CuaRlError, RuntimeError):
    """An external service (gym, agent, model server, monitor) failed or answered badly.

    ``status`` is the HTTP status when there was an answer, ``None`` for transport failures.
    """

    def __init__(self, message: str, *, status: int | None = None, body: object = None):
        super().__init__(message)
        self.status = status
        self.body = body


class GymError(ServiceError):
    """The gym server (genv) failed a call."""


class AgentError(ServiceError):
    """The gbox-mini-agent service failed a call."""


class ModelServerError(ServiceError):
    """The model server (vLLM) failed a call."""


class MonitorError(ServiceError):
    """The Training Monitor refused or failed a call."""


class RejectedEpisode(CuaRlError):
    """An episode cannot become a training row; ``reason`` is a stable, countable code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
