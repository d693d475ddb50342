"""The agent: what a computer-use agent does in an episode, and how a run of it is driven.

The agent's policy, product code whoever runs it: the action language and its parsing
(``actions``), the context policies (``context``: which messages each step sends the model) and
the model formats (``flavours``: the sim's language, MAI-UI, Qwen3-VL). ``loop`` runs one run with
them (screenshot, prompt, model call through the episode's gateway URL, the parsed action on the
box, gbox-mini-agent's events); ``run`` is a run's state and the checks of its body. The local
agent service (``cua_rl.sim.agent``) serves this loop over gbox-mini-agent's API; with
``agent.mode: builtin`` the rollout worker runs it itself (``builtin``).

An episode asks for a run as a ``RunSpec`` and gets a ``RunResult`` back (``spec``), from the
agent service (``service_driver``, whose polls ``event_log`` de-duplicates; the service's HTTP
client is ``cua_rl.clients.gbox_mini_agent``) or from the built-in loop. Nothing is imported here:
importing one module does not load the others (docs/agent.md).
"""
