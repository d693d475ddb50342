"""Local stand-ins for the production services, speaking the same wire formats.

``python -m cua_rl.sim gym ...`` serves the genv protocol over a simulated phone;
``python -m cua_rl.sim agent ...`` serves the gbox-mini-agent protocol against that gym.
"""
