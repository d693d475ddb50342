"""``train.py --check``: the config is valid and every service it names answers, one line each.

Nothing trains and nothing is written: the config is loaded whole first, as a launch loads it,
and every problem it has (missing keys, values out of range, folders that cannot be created:
config_load.py; a model folder that is not a checkpoint or that the config does not fit, a
workflow that does not import, a gateway the agent cannot reach: preflight.py) is one ``config
error:`` line of the same run, exit 2, the line a launch prints for it. Then the policy's family
is named, the gym lists and selects its tasks (so a bad selection shows here too), the agent
answers a run lookup, an external endpoint serves the model, the monitor accepts the token or
its embedded database is a monitor's (read, never created), the GPU inference stack (``stack``)
and under ray or slurm the lines of ``check_cluster`` (Ray address, sbatch, shared paths). A
line says ``skip`` for what it did not look at; a failing line says the fix; the exit status is
1 when any check fails.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from cua_rl.agent.function import describe as describe_agent_function
from cua_rl.app.check_result import CheckResult
from cua_rl.app.config import CUAConfig
from cua_rl.clients.genv import GenvClient
from cua_rl.errors import AgentError, ConfigError, CuaRlError, GymError
from cua_rl.tasks import Task, load_tasks, select_tasks


def _reason(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"unreachable ({exc})"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


async def fetch_tasks(config: CUAConfig) -> list[Task]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as http:
        client = None
        if config.gym.source.kind == "gym":
            client = GenvClient(
                config.gym.base_url, config.gym.gym_id, client=http, timeouts=config.gym.timeouts
            )
        return await load_tasks(config.gym.source, client)


async def check_gym(config: CUAConfig) -> CheckResult:
    try:
        tasks = await fetch_tasks(config)
        split = select_tasks(tasks, config.gym.selection)
    except (GymError, CuaRlError, httpx.HTTPError, OSError) as exc:
        return CheckResult("gym", False, f"{config.gym.base_url}: {_reason(exc)}")
    return CheckResult(
        "gym",
        True,
        f"{config.gym.base_url or config.gym.source.kind}: {len(tasks)} tasks, "
        f"{len(split.train)} train / {len(split.eval)} eval after selection",
    )


AGENT_FIX = (
    "start the agent service (gbox-mini-agent, or `python -m cua_rl.sim agent` for the local "
    "one), or fix the host and port of agent.base_url; agent.mode=builtin runs the agent loop "
    "in the rollout workers instead"
)
MONITOR_FIX = (
    "start the monitor (`python -m cua_rl.monitor serve --db FILE --host 0.0.0.0 --port PORT`, "
    "docs/monitor.md), or fix monitor.base_url; monitor.db_path with monitor.base_url empty "
    "serves an embedded one"
)


async def check_agent(config: CUAConfig, http: httpx.AsyncClient) -> CheckResult:
    if config.agent.mode == "builtin":
        return CheckResult("agent", True, "builtin: the rollout workers run the agent loop")
    if config.agent.mode == "function":
        try:
            return CheckResult("agent", True, describe_agent_function(config.agent.function))
        except ConfigError as exc:  # the config's load imported it; a check run imports again
            return CheckResult("agent", False, str(exc))
    # No health endpoint is known; any HTTP answer to a run lookup proves it serves.
    agent_url = config.agent.base_url.rstrip("/")
    try:
        resp = await http.get(f"{agent_url}/runs/cua-rl-check")
    except (httpx.HTTPError, AgentError) as exc:
        return CheckResult("agent", False, f"{agent_url or '(unset)'}: {_reason(exc)}: {AGENT_FIX}")
    ok = resp.status_code in (200, 404)
    detail = f"{agent_url}: answers (HTTP {resp.status_code})"
    return CheckResult(
        "agent",
        ok,
        detail
        if ok
        else f"{detail}, not as gbox-mini-agent does (200 or 404): is agent.base_url "
        "the agent service's root?",
    )


async def check_model(config: CUAConfig, http: httpx.AsyncClient) -> CheckResult:
    # An external endpoint must serve the model; the engine's own servers are started later.
    from cua_rl.app.check_cluster import is_local_model, model_folder_problem

    path = config.model_path()
    # The trainer loads the policy from its folder even when an external endpoint serves it.
    # A launch refuses the same (preflight.py); --check loads as a launch does, so only a
    # caller of this function alone meets it here.
    problem = model_folder_problem(path) if path else "actor.path is unset"
    if problem:
        return CheckResult("model", False, f"{problem}: point actor.path at the checkpoint folder")
    if not config.endpoint.base_url:
        if not is_local_model(path):
            return CheckResult.skip(
                "model", f"{path!r} is a hub id: the workers download it, not looked up here"
            )
        return CheckResult("model", True, f"engine servers started by the trainer from {path!r}")
    url = config.endpoint.base_url.rstrip("/")
    try:
        resp = await http.get(f"{url}/models")
        resp.raise_for_status()
        names = [m.get("id") for m in resp.json().get("data", [])]
    except (httpx.HTTPError, ValueError) as exc:
        return CheckResult(
            "model",
            False,
            f"{url}: {_reason(exc)}: start the model server, or fix endpoint.base_url (an "
            "OpenAI base URL ending in /v1)",
        )
    want = config.endpoint.model_name or config.model_path()
    ok = not want or want in names
    return CheckResult("model", ok, f"{url}: serves {names}" + ("" if ok else f", not {want!r}"))


async def check_monitor(config: CUAConfig, http: httpx.AsyncClient) -> CheckResult:
    # A URL must answer with the token; an embedded monitor must open its database.
    base, token = config.monitor.resolved()
    if not config.monitor.enabled:
        return CheckResult("monitor", True, "disabled")
    if base:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            resp = await http.get(f"{base.rstrip('/')}/api/trainings?limit=1", headers=headers)
        except httpx.HTTPError as exc:
            return CheckResult("monitor", False, f"{base}: {_reason(exc)}: {MONITOR_FIX}")
        ok = resp.status_code == 200
        why = (
            "token refused: set monitor.token (or $MONITOR_PROJECT_TOKEN) to the token the "
            "monitor was started with"
            if resp.status_code == 401
            else f"HTTP {resp.status_code}: is monitor.base_url the monitor's root?"
        )
        return CheckResult("monitor", ok, f"{base}: {'ok' if ok else why}")
    return embedded_monitor_check(Path(config.monitor.db_path))


def embedded_monitor_check(db: Path) -> CheckResult:
    """An existing database must be a monitor's; a missing one is created when the training
    starts (the loader found its folder writable). Read-only and ``immutable``: opening a WAL
    database read-only would otherwise create its -shm and -wal files."""
    if not db.exists():
        return CheckResult("monitor", True, f"embedded, database {db} (created at the start)")
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)) as conn:
            version = conn.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
    except sqlite3.Error as exc:
        return CheckResult(
            "monitor", False,
            f"{db}: not a monitor database ({exc}): point monitor.db_path at another file",
        )  # fmt: skip
    return CheckResult("monitor", True, f"embedded, database {db} (schema version {version})")


def gateway_check(config: CUAConfig) -> CheckResult:
    """The gateway starts with the rollout workers; what can be checked now is whether the agent
    will be able to reach the address it is told (at a launch, a config error:
    ``preflight.py``)."""
    from cua_rl.app.preflight import GATEWAY_FIX, gateway_reach

    reachable, detail = gateway_reach(config)
    if not reachable:
        agent_host = urlsplit(config.agent.base_url).hostname
        detail += (
            f"; the agent at {agent_host} runs elsewhere and cannot reach a loopback gateway: "
            f"{GATEWAY_FIX}"
        )
    return CheckResult("gateway", reachable, detail)


async def check_services(config: CUAConfig, *, timeout: float = 10.0) -> list[CheckResult]:
    results = [await check_gym(config)]
    async with httpx.AsyncClient(timeout=timeout) as http:
        results.append(await check_agent(config, http))
        if config.endpoint.mode == "gateway":
            results.append(gateway_check(config))
        results.append(await check_model(config, http))
        results.append(await check_monitor(config, http))
    return results


def family_check(config: CUAConfig) -> CheckResult:
    """The policy's family as its config.json says, and whether the config fits it."""
    from cua_rl.app.family import detect_family, family_problems

    try:
        family = detect_family(config.actor.path) if config.actor.path else None
    except ConfigError as exc:
        return CheckResult("family", False, str(exc))
    if family is None:
        # A missing local folder is a config error (preflight.py): this is a hub id.
        return CheckResult.skip(
            "family",
            f"{config.actor.path!r} is a hub id: the workers download it and read its family",
        )
    problems = family_problems(family, config)
    return CheckResult("family", not problems, "; ".join([family.describe(), *problems]))


def workflow_check(config: CUAConfig) -> CheckResult:
    """AReaL's workers import ``workflow:`` by its dotted path; a bad one fails here, not there."""
    from cua_rl.app.config_checks import import_workflow

    try:
        import_workflow(config.workflow)
    except ConfigError as exc:
        return CheckResult("workflow", False, str(exc))
    return CheckResult("workflow", True, f"{config.workflow} imports")


def run_check(config: CUAConfig) -> int:
    print(f"ok   config   {config.experiment_name}/{config.trial_name} is valid")
    from cua_rl.app.check_cluster import cluster_checks
    from cua_rl.app.check_gpu import gpu_check
    from cua_rl.app.harness import cuda_available
    from cua_rl.app.stack import stack_check

    results = [
        family_check(config),
        workflow_check(config),
        stack_check(config),
        *gpu_check(config, cuda=cuda_available()),
        *cluster_checks(config, dict(os.environ)),
        *asyncio.run(check_services(config)),
    ]
    for r in results:
        print(r.line())
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"unreachable or misconfigured: {', '.join(failed)}")
        return 1
    return 0
