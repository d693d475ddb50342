"""A local gbox-mini-agent: the same HTTP API and event format (docs/agent.md), run against the sim gym.

Each ``POST /runs`` starts an asyncio task on the server's loop running the shared agent loop
(``cua_rl.agent``, which the workflow also runs itself in ``agent.mode: builtin``); every
run shares one ``httpx.AsyncClient``, so parallel runs only meet in the gym and the model server.
A step is:
capture a screenshot on the gym, build the request's messages with the run's context policy
(``cua_rl.agent.context``: ``full`` append-only by default, ``mai-ui`` or ``current``; images as
data URLs, or the gym's HTTP URLs with ``imageMode: "url"``), send them to ``model.baseUrl`` with
``logprobs`` and ``return_token_ids``, parse one action (``cua_rl.agent.actions`` / the flavour;
``mai-ui`` asks again with the same body while the reply does not parse), execute it on the gym, and
record events. Timestamps are strictly increasing per run, so ``(type, ts, step, actionIndex)``
identifies every event.

Reasons in ``run_end`` / ``GET /runs/{id}``: ``finished`` and ``max_steps`` (status
``completed``); ``timeout`` (maxRunTimeSec), ``step_timeout`` (maxStepTimeSec), ``model_error``,
``env_error`` and ``internal_error`` (status ``failed``). A model output with no valid action is
reported as an ``action_executed`` whose action is named ``invalid`` (nothing is executed) and the
run goes on; ``error`` events are kept for failures of the services around the agent.

Model options beyond ``baseUrl`` / ``name`` / ``provider`` (all optional): ``logprobs`` (default
true), ``topLogprobs``, ``temperature`` (1.0), ``maxTokens`` (32), ``seed``, ``imageMode``
(``data`` | ``url``), ``constrain`` (``regex``: vLLM structured outputs limited to the action
language; ``ascii``: ``allowed_token_ids`` = printable ASCII + end tokens) and ``actions`` (action
names the regex allows, e.g. without ``finished``), ``context`` / ``historyN`` (the context
policy, docs/agent.md) and ``parse`` (``strict``, or ``lenient``: a
reply with no valid call taps the grid cell its first character names, see
``cua_rl.agent.actions``).
"""

from cua_rl.agent.loop import END_TOKENS, IMAGE_CALL_ID
from cua_rl.agent.run import BadRunRequest, Run, parse_time, validate_run_body
from cua_rl.sim.agent.app import AgentServer, create_app, main
from cua_rl.sim.agent.service import AgentServerConfig, AgentService

__all__ = [
    "END_TOKENS",
    "IMAGE_CALL_ID",
    "AgentServer",
    "AgentServerConfig",
    "AgentService",
    "BadRunRequest",
    "Run",
    "create_app",
    "main",
    "parse_time",
    "validate_run_body",
]
