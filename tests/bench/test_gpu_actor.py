"""bench/gpu_actor.py's table on results written by hand: the ratios worked out by hand, the
skipped and failed layouts shown as such, the smoke's entries kept out of the table."""

from __future__ import annotations

import pytest

from tests.bench import load_bench


@pytest.fixture
def bench():
    with load_bench("gpu_actor") as module:
        module.RESULTS.clear()
        yield module
        module.RESULTS.clear()


def _rec(actor, layout, step_s, **extra):
    logp = round(step_s / 4, 2)
    return dict(
        actor=actor, layout=layout, turns=30, rows=60, tokens=1000, row_images=174, encoded=74,
        mbs=7, logp_s=logp, update_s=round(step_s - logp, 2), step_s=step_s, peak_gib=51.2,
        **extra,
    )  # fmt: skip


def test_the_ratios_are_against_the_same_actors_full_row_and_areals(bench):
    bench.RESULTS += [
        dict(smoke="qwen2-vl", ok=True, step_s=3.0),  # not a table row
        _rec("cua", "full", 20.0),
        _rec("cua", "window-3", 44.0),
        _rec("areal", "full", 19.0),
        _rec("areal", "window-3", 65.0),
        _rec("cua-no-dedup", "window-3", 52.0),
        dict(actor="areal", layout="window-5", turns=30, error="skipped"),
    ]
    text = bench.table()
    assert "  cua window-3 T=30: 2.20x" in text  # 44 / 20
    assert "  areal window-3 T=30: 3.42x" in text  # 65 / 19
    assert "  cua/areal window-3 T=30: 0.68x" in text  # 44 / 65
    assert "  cua/areal full T=30: 1.05x" in text  # 20 / 19
    assert "  cua-no-dedup/areal window-3 T=30: 0.80x" in text  # 52 / 65: a part of cua's
    assert "areal             window-5  30  skipped" in text
    assert "qwen2-vl" not in text
