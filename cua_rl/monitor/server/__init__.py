"""The monitor's server side: the SQLite database, its ingest API and the dashboard.

- ``schema`` / ``migrations``: the schema as versioned migrations (WAL, foreign keys on).
- ``store``: atomic, idempotent batch ingest and reads; no HTTP.
- ``compat``: the existing clients' dialect, mapped onto ours.
- ``app``: the HTTP API; ``dashboard`` / ``views``: the pages; ``screenshots``: the screenshot store.
"""
