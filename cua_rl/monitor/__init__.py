"""The Training Monitor: a SQLite record of trainings down to each action, and its clients.

- ``protocol``: what both sides agree on (client id formats, record kinds, status words).
- ``worker``: the client side used during training (client, recorder, context, training records).
- ``server``: the database, its ingest API and the dashboard (``python -m cua_rl.monitor serve``).
"""
