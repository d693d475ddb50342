"""The Training Monitor: a SQLite record of trainings down to each action, and its clients.

- ``protocol``: what both sides agree on (record kinds, status words, client id formats,
  screenshot uris); neither side imports the other.
- ``worker``: the client side used during training (client, recorder, context, training records,
  screenshot uploader).
- ``server``: the database, its ingest API and the dashboard (``python -m cua_rl.monitor serve``).
"""
