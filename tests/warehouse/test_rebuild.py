"""Stored episodes rebuild the converter's rows exactly (no network, the tiny model's real
processor); a malformed stored record is refused naming its field."""

from __future__ import annotations

import base64
import json

import pytest

from cua_rl.testing.models import TOKEN_ID
from cua_rl.warehouse import (
    RebuildError,
    StoredEpisodeError,
    check_record,
    episode_from_json,
    rebuild_rows,
    to_record,
)

from .conftest import assert_rows_equal, stored

PAD = TOKEN_ID["<|image_pad|>"]


@pytest.mark.parametrize("break_prefix", [False, True], ids=["one-row", "two-rows"])
def test_a_stored_episode_rebuilds_the_trained_rows_exactly(images, processor, break_prefix):
    ep, result = stored(images, processor, break_prefix=break_prefix)
    assert len(ep.rows) == (2 if break_prefix else 1)
    # Through the wire form (JSON, the blob in base64), as the monitor keeps and answers it.
    back = episode_from_json(json.loads(json.dumps(to_record(ep))))
    back.images.update(ep.images)
    assert_rows_equal(rebuild_rows(back, processor), result.rows)
    assert (back.version_min, back.version_max) == (3, 4)
    assert back.reward == 1.0 and back.episode_id == 77


def test_the_export_keeps_each_rows_messages_with_image_placeholders(images, processor):
    ep, _ = stored(images, processor, break_prefix=False)
    (row,) = ep.rows
    parts = [p for m in row.messages for p in m["content"]]
    assert sum(p["type"] == "image" for p in parts) == len(row.images) == 2
    assert not any("data:" in json.dumps(p) for p in parts)  # no pixels in the messages
    assert [t["text"] for t in ep.turns] == ["tap(1,2)", "tap(1,2)"]
    assert ep.turns[0]["actions"][0]["name"] == "tap"


def test_a_missing_image_or_another_processor_is_a_clear_error(images, processor):
    ep, _ = stored(images, processor)
    digest = ep.rows[-1].images[0]
    lacking = episode_from_json(to_record(ep))
    with pytest.raises(RebuildError, match=digest):
        rebuild_rows(lacking, processor)
    lacking.images.update(ep.images)
    # A row whose prompt lost its first image's pads: its ids no longer fit its images.
    row = lacking.rows[0]
    drop = row.input_ids.index(PAD)
    keep = [i for i in range(len(row.input_ids)) if not drop <= i < drop + 3]
    for name in ("input_ids", "loss_mask", "logprobs", "versions"):
        setattr(row, name, [getattr(row, name)[i] for i in keep])
    with pytest.raises(RebuildError, match="pad runs"):
        rebuild_rows(lacking, processor)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.update(data=base64.b64encode(b"not zlib").decode()), "data"),
        (lambda r: r.update(data="***"), "data"),
        (lambda r: r["rows"][0].update(tokens=r["rows"][0]["tokens"] + 1), "data"),
        (lambda r: r["rows"][0].update(images=["abc"]), "rows[0].images"),
        (lambda r: r.update(rows=[]), "rows"),
        (lambda r: r.update(format=99), "format"),
        (lambda r: r.update(success="yes"), "success"),
        (lambda r: r.update(version_min=9, version_max=1), "version_min"),
        (lambda r: r.pop("task_id"), "task_id"),
    ],
)
def test_malformed_records_are_refused_naming_the_field(images, processor, change, field):
    ep, _ = stored(images, processor)
    record = to_record(ep)
    check_record(record)  # the unchanged record passes
    change(record)
    with pytest.raises(StoredEpisodeError) as info:
        check_record(record)
    assert info.value.field == field
