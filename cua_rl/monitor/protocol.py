"""What both sides of the monitor agree on: client id formats, record kinds, status words.

The worker side (``cua_rl.monitor.worker``) formats ids with these functions and the server side
(``cua_rl.monitor.server``) parses and resolves them, so a format lives in one place. Steps, evals
and baselines use the existing clients' formats with the run name in place of the server id.
"""

from __future__ import annotations


def step_client_id(run: str, step: int) -> str:
    return f"step-{run}-{step}-0"


def eval_client_id(run: str, step: int) -> str:
    return f"eval-{run}-{step}"


def baseline_client_id(run: str) -> str:
    return f"baseline-{run}-0"
