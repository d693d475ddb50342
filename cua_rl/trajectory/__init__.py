"""Agent event logs -> exact multi-turn VLM training rows (pure functions, no network inside).

Pipeline, as the workflow calls it::

    parsed = events_to_turns(events)                          # events -> turns
    urls = image_urls_needed(parsed.turns, config)
    fetched = await fetch_images(urls, config, client=client)  # the only I/O (http(s) only)
    result = convert_turns(parsed.turns, processor=processor, reward=reward,
                           version=engine.get_version(), config=config,
                           fetched_images=fetched)  # turns -> a row per run of calls
    rows = result.rows          # None when rejected; result.reason is the code
    batch = result.row          # the rows as one padded batch, what AReaL trains

``convert_events`` does the first and last step in one call for logs whose images are data URLs.
"""

from __future__ import annotations

from cua_rl.core.images import (
    check_image_url,
    fetch_images,
    load_images,
    process_images,
)
from cua_rl.core.row import ROW_FIELDS, ROW_KEYS, validate_row
from cua_rl.errors import RejectedEpisode
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.trajectory.events import ParsedEvents, Turn, events_to_turns, load_event_log
from cua_rl.trajectory.rows import (
    ConversionResult,
    Segment,
    convert_turns,
    episode_id_of,
    image_urls_needed,
    row_summary,
    split_segments,
)


def convert_events(
    events,
    *,
    processor,
    reward: float,
    version,
    config: TrajectoryConfig | None = None,
    fetched_images=None,
    episode_id: int = 0,
) -> ConversionResult:
    """events -> row in one call; malformed events become a rejection, not an exception."""
    try:
        parsed = events_to_turns(events)
    except RejectedEpisode as exc:
        return ConversionResult(None, exc.reason, exc.detail, {"turns": 0})
    result = convert_turns(
        parsed.turns,
        processor=processor,
        reward=reward,
        version=version,
        config=config,
        fetched_images=fetched_images,
        episode_id=episode_id,
    )
    result.stats["incomplete_turns"] = parsed.incomplete_turns
    result.stats["duplicate_events"] = parsed.duplicates
    return result


__all__ = [
    "ROW_FIELDS",
    "ROW_KEYS",
    "validate_row",
    "ConversionResult",
    "ParsedEvents",
    "Segment",
    "TrajectoryConfig",
    "Turn",
    "check_image_url",
    "convert_events",
    "convert_turns",
    "episode_id_of",
    "events_to_turns",
    "fetch_images",
    "image_urls_needed",
    "load_event_log",
    "load_images",
    "process_images",
    "row_summary",
    "split_segments",
]
