"""cua-rl: train computer-use agents (Android / Linux GUI) with AReaL PPO/GRPO.

The application is in the package: ``app`` (the launcher, its config, the demo, the learning
run), ``rollout`` (the AReaL workflow and its episode), ``gateway`` (the per-episode model
endpoint), ``trajectory`` and ``reward`` (pure conversion functions), ``monitor`` (worker and
server of the Training Monitor), ``areal`` (the production AReaL integration), ``cpu`` (the
no-GPU harness), ``core`` (what several packages share), clients of the gym and the agent, and
``sim`` (local stand-ins that speak the production wire formats). ``examples/cua_agent`` is the
AReaL example: a short ``train.py``, its configs and a workflow subclass showing the hooks.
"""

__version__ = "0.1.0"
