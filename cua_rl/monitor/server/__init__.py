"""The monitor's server side: the SQLite database, its ingest API and the dashboard.

- ``schema`` / ``migrations``: the schema as versioned migrations (WAL, foreign keys on).
- ``store`` / ``batch``: atomic, idempotent batch ingest; no HTTP.
- ``read``: the read model, the one place that reads the database (API, pages, demo, benches).
- ``compat``: the existing clients' dialect, mapped onto ours.
- ``app``: the HTTP API; ``dashboard`` / ``views``: the pages; ``screenshots``: the screenshot store.
"""
