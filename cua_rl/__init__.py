"""cua-rl: train computer-use agents (Android / Linux GUI) with AReaL PPO/GRPO.

The package is a library of clients (gym, agent, monitor), pure conversion functions
(trajectory, reward) and local stand-ins (sim) that speak the production wire formats.
The AReaL-facing pieces live in ``examples/cua_agent``.
"""

__version__ = "0.1.0"
