"""The agent loop, one implementation for the local agent service and the rollout workflow.

``loop.py``: ``AgentLoop`` runs a gbox-mini-agent run (screenshot on the gym's box API, the
flavour's prompt under the run's context policy, a model call, the parsed action executed on the
box) and records gbox-mini-agent's events; ``run.py``: a run's state and the checks of its body;
``builtin.py``: ``agent.mode: builtin``, the workflow running the loop in the rollout worker and
reading its end as the service driver would (docs/agent.md).
"""

from cua_rl.agent_loop.builtin import run_builtin
from cua_rl.agent_loop.loop import AgentLoop, LoopConfig
from cua_rl.agent_loop.run import BadRunRequest, EndRun, Run, validate_run_body

__all__ = [
    "AgentLoop",
    "BadRunRequest",
    "EndRun",
    "LoopConfig",
    "Run",
    "run_builtin",
    "validate_run_body",
]
