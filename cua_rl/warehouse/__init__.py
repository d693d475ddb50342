"""The trajectory warehouse: accepted episodes stored so their training rows rebuild exactly.

A rollout worker stores each accepted training episode (``monitor.store_episodes``: successes by
default) through its monitor client as an ``episodes`` ingest record (token data, image hashes)
plus ``episode_images`` records (the bytes the model received, once per hash per client); the
monitor keeps the first in its ``episode_store`` table and the images in its screenshot store.
``MonitorClient.successes`` asks the monitor for a task's recorded successes (replay);
``rebuild_rows`` turns one back into the rows the workflow trained; ``examples_of`` turns one into
supervised examples, one per trained row, which ``python -m cua_rl.monitor export`` writes as a
Hugging Face dataset (docs/warehouse.md).
"""

from __future__ import annotations

from cua_rl.warehouse.episode import (
    STORE_POLICIES,
    StoredEpisode,
    StoredEpisodeError,
    StoredRow,
    check_record,
    episode_from_json,
    from_parts,
    to_record,
)
from cua_rl.warehouse.examples import episode_from_examples, examples_of
from cua_rl.warehouse.rebuild import (
    RebuildError,
    model_messages,
    rebuild_rows,
    stored_episode_of,
    stored_from_rows,
)

__all__ = [
    "STORE_POLICIES",
    "RebuildError",
    "StoredEpisode",
    "StoredEpisodeError",
    "StoredRow",
    "check_record",
    "episode_from_examples",
    "episode_from_json",
    "examples_of",
    "from_parts",
    "model_messages",
    "rebuild_rows",
    "stored_episode_of",
    "stored_from_rows",
    "to_record",
]
