"""A replayed success's steps, read from its stored form as another training's worker gets it
(through the warehouse's wire form and a rebuild), are the steps of the episode as it ran."""

from __future__ import annotations

import json

import pytest

from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.observer import stored_steps
from cua_rl.credit.steps import episode_steps
from cua_rl.warehouse import episode_from_json, rebuild_rows, to_record
from tests.warehouse.conftest import converted, stored

CONFIG = StepCreditConfig(enabled=True)


def _as_ran(images, processor, break_prefix: bool):
    turns, result = converted(images, processor, break_prefix=break_prefix)
    return episode_steps(
        episode_id=77,
        rows=result.rows,
        row_images=result.row_images,
        row_turns=result.row_turns,
        turns={t.index: (t.step, list(t.actions)) for t in turns},
        images=result.image_data,
        config=CONFIG.key,
        row_spans=result.row_spans,
    )


@pytest.mark.parametrize("break_prefix", [False, True], ids=["one-row", "two-rows"])
def test_a_stored_success_gives_the_steps_it_ran(images, processor, break_prefix):
    ran = _as_ran(images, processor, break_prefix)
    ep, _ = stored(images, processor, break_prefix=break_prefix)
    record = json.loads(json.dumps(to_record(ep)))
    assert all(row["spans"] for row in record["rows"])
    back = episode_from_json(record)
    back.images.update(ep.images)
    got = stored_steps(back, rebuild_rows(back, processor), CONFIG)
    assert got is not None
    assert got.steps == ran.steps and got.spans == ran.spans
    assert [s.key.kind for s in got.steps] == ["phash", "phash"]  # no gym key in these events
    # A record stored before spans were kept: the loss mask's runs, which agree here.
    for row in record["rows"]:
        del row["spans"]
    old = episode_from_json(record)
    old.images.update(ep.images)
    assert stored_steps(old, rebuild_rows(old, processor), CONFIG).spans == ran.spans


def test_a_stored_episode_without_its_turns_gives_no_steps(images, processor):
    ep, _ = stored(images, processor)
    ep.turns = []
    assert stored_steps(ep, rebuild_rows(ep, processor), CONFIG) is None
