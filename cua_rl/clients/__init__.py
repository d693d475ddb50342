"""Clients of the external services an episode talks to, one module per service, named after it.

Each has one async method per endpoint and takes an injectable ``httpx.AsyncClient``; what the
answers mean is parsed beside it. ``genv``: the gym server (executions, evaluation; its answers'
many shapes in ``genv_answers``); ``gbox_mini_agent``: the agent service (runs, their status and
events; following a run to its end is ``cua_rl.agent.service_driver``'s). Nothing is imported
here.
"""
