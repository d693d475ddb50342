"""The Training Monitor: a SQLite record of trainings down to each action, and its clients.

- ``schema`` / ``migrations``: the seed schema as versioned migrations (WAL, foreign keys on).
- ``store``: atomic, idempotent batch ingest and the dashboard's reads; no HTTP.
- ``app`` / ``__main__``: the HTTP API (``python -m cua_rl.monitor serve``).
- ``client``: the non-blocking, batching, spooling client used during training.
- ``context`` / ``recorder``: the current training/step/eval/baseline, and the per-rollout recorder.
"""
