"""Clients of the external services an episode talks to, one module per service, named after it.

Each has one async method per endpoint and takes an injectable ``httpx.AsyncClient``; what the
answers mean is parsed beside it. ``genv``: the gym server (executions, evaluation; its answers'
many shapes in ``genv_answers``). Nothing is imported here.
"""
