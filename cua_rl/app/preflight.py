"""What a launch needs beyond a valid config, found before anything starts.

The table (``config_checks.py``) judges values; these judge what the values point at, on this
machine: the policy's folder is a checkpoint (``config.json`` and weights) whose family the
config fits (``family.py``), the ``workflow:`` class imports, and the agent can reach the gateway
it will be told. Each is a ``FieldError`` naming its key, so the loader reports it as every other
mistake: one ``config error:`` line saying whether the file or the command line set the key, all
of a load's problems at once, exit 2. ``train.py`` asks for them (``load_config(...,
launch=True)``) both at a launch and under ``--check``, so a mistake ``--check`` reports is the
same line at a launch, before a worker starts or the monitor is written to: a missing model
folder used to surface minutes later as a transformers traceback, with a ``failed`` training in
the monitor. A plain ``load_config`` (tests, tools) leaves them out: a config may name a model
this machine does not hold.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from cua_rl.app.config_checks import FieldError, import_workflow, lookup

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def model_problems(config: Any) -> list[FieldError]:
    """The policy's folder, then what its family needs of the config (nothing for a hub id)."""
    from cua_rl.app.check_cluster import model_folder_problem
    from cua_rl.app.family import detect_family, family_field_problems
    from cua_rl.errors import ConfigError

    path = lookup(config, "actor.path")
    if not isinstance(path, str) or not path:
        return []  # unset: the launch table's row says so
    problem = model_folder_problem(path)
    if problem:
        return [
            FieldError(
                "actor.path",
                f"{problem}: point actor.path at the policy's checkpoint folder (a Hugging Face "
                "folder with config.json and *.safetensors), or at a hub id such as org/name",
            )
        ]
    try:
        family = detect_family(path)
    except ConfigError as exc:
        return [FieldError("actor.path", str(exc))]
    if family is None:
        return []
    try:
        return family_field_problems(family, config)
    except (TypeError, ValueError):
        return []  # a value the table refuses (reported there) or a malformed limit_mm_per_prompt


def workflow_problems(config: Any) -> list[FieldError]:
    path = lookup(config, "workflow")
    if not isinstance(path, str):
        return []
    try:
        import_workflow(path)
    except FieldError as exc:
        return [exc]
    return []


def gateway_reach(config: Any) -> tuple[bool, str]:
    """Whether the agent can reach the gateway it will be told, and where each rollout worker
    listens and what the agent is told."""
    bind = lookup(config, "gateway.bind_host")
    public = lookup(config, "gateway.public_host")
    port = lookup(config, "gateway.bind_port")
    told = public or ("the worker's IP" if bind in ("0.0.0.0", "::", "") else bind)
    detail = (
        f"each rollout worker listens on {bind}:{port or 'a free port'}, the agent is told {told}"
    )
    return _agent_is_local(config) or (bind not in LOOPBACK and told not in LOOPBACK), detail


def _agent_host(config: Any) -> str:
    return (urlsplit(str(lookup(config, "agent.base_url") or "")).hostname or "").lower()


def _agent_is_local(config: Any) -> bool:
    # Only an agent service runs elsewhere: any other agent (the builtin loop, ...) runs in the
    # rollout worker, beside its gateway.
    service = lookup(config, "agent.mode") in ("service", None)
    return _agent_host(config) in LOOPBACK or not service


GATEWAY_FIX = (
    "set gateway.bind_host=0.0.0.0 (and gateway.public_host to an address it can reach, or "
    "empty for the worker's IP)"
)


def gateway_problems(config: Any) -> list[FieldError]:
    if lookup(config, "endpoint.mode") != "gateway" or gateway_reach(config)[0]:
        return []
    if not _agent_host(config):
        return []  # no agent URL: the table's row for agent.base_url says so
    public = lookup(config, "gateway.public_host")
    key = "gateway.public_host" if public in LOOPBACK else "gateway.bind_host"
    return [
        FieldError(
            key,
            f"{key}={lookup(config, key)}: the agent at {_agent_host(config)} "
            f"(agent.base_url) runs on another host and cannot reach a loopback gateway: "
            f"{GATEWAY_FIX}",
        )
    ]


def preflight_problems(config: Any) -> list[FieldError]:
    """Every problem above, each with its key."""
    return [*model_problems(config), *workflow_problems(config), *gateway_problems(config)]
