"""The training's connection to a Ray cluster (``scheduler.type: ray``).

AReaL's ``RayScheduler`` runs each worker as a Ray actor and never calls ``ray.init`` itself: the
first Ray call would connect with Ray's defaults. ``connect`` connects first, to the cluster named
by ``RAY_ADDRESS`` (Ray's own variable), with a job-wide runtime environment:

- the controller's ``CUA_RL_*`` variables (``CUA_RL_LOG_LEVEL``): under the local scheduler
  workers inherit the controller's environment, Ray actors do not, and AReaL passes them only
  their ``SchedulingSpec.env_vars`` and ``PYTHONPATH``. Settings travel in the workflow's
  settings instead, the monitor's URL and token included;
- optionally a ``worker_process_setup_hook`` that every Ray worker process of this job runs
  before any actor or task (the no-GPU harness applies its worker-side patches there; under the
  local scheduler the same patches come in through ``SchedulingSpec.cmd``, which Ray ignores).

Ray merges an actor's own ``env_vars`` (AReaL's) with the job's, so both reach the workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from cua_rl.errors import ConfigError

# The monitor's URL and token are not among them: the trainer resolves them once and hands them
# to the workers in their settings (cua_rl.app.config.MonitorSection.resolved).
FORWARDED_PREFIX = "CUA_RL_"


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The controller's variables the workers read."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIX)}


def connect(setup_hook: str | None = None, *, prepare: Callable[[], None] | None = None) -> str:
    """Connect this process to the Ray cluster at ``RAY_ADDRESS``; return that address.

    ``prepare`` runs once Ray is imported, before it connects: the CPU harness's keeps a
    127.0.0.1 address as given, for a cluster on this machine (``cua_rl.app.harness``).
    """
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise ConfigError(
            "scheduler.type=ray needs a running Ray cluster: set RAY_ADDRESS=host:port (the "
            "head's GCS address; `make demo-ray` starts a local one)"
        )
    import ray

    if prepare is not None:
        prepare()
    runtime_env: dict = {"env_vars": forwarded_env()}
    if setup_hook:
        runtime_env["worker_process_setup_hook"] = setup_hook
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=address, runtime_env=runtime_env, logging_level="WARNING")
    return address
