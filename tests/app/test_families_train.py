"""Each production family trained for real on the local stack: ``make demo``'s launcher with the
family's tiny model (its own template and processor), vLLM CPU serving it through the gateway,
AReaL's FSDP actor with selective logits, two asynchronous PPO steps (every task trains, none
evaluates). Qwen2.5-VL trains a second time with ``logits.selective=false`` (AReaL's own actor,
``CuaPPOActor``): its image-position fix must not depend on the selective-logits switch.

One training per family serves every check: it completes with no episode rejected, no turn
breaks the multi-turn prefix, rows carry their screenshots, and at step 1 (every trained token
sampled by version 0, the weights the trainer holds) the trainer's own transformers forward
reproduces vLLM's logprob of every trained token within 1e-3: AReaL records the extremes of
log(trainer / vLLM) over the batch's tokens as ``behave_approx_kl``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from cua_rl.testing.cache import FAMILY_KINDS
from tests.conftest import NO_EVAL, run_demo

TOL = 1e-3

pytestmark = pytest.mark.slow


# (kind, extra overrides): each family on the default actor, and Qwen2.5-VL (the family whose
# positions the trainer fixes) on AReaL's unpatched-logits actor too.
CASES = [(kind, ()) for kind in FAMILY_KINDS] + [("qwen2.5-vl", ("logits.selective=false",))]


def _train(run_dir: Path, kind: str, overrides: tuple[str, ...]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    run = run_demo(run_dir, "--model", kind, *NO_EVAL, *overrides, timeout=1200)
    rc, out = run.returncode, run.output
    return rc, out, time.monotonic() - t0


def _case_id(case: tuple[str, tuple[str, ...]]) -> str:
    kind, overrides = case
    return kind + ("-full-logits" if "logits.selective=false" in overrides else "")


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def trained(request, tmp_path_factory):
    kind, overrides = request.param
    name = _case_id(request.param)
    run_dir = tmp_path_factory.mktemp(name) / "run"
    rc, out, seconds = _train(run_dir, kind, overrides)
    print(f"{name}: trained in {seconds:.0f}s")  # pytest -s shows each family's cost
    return name, run_dir / "monitor.db", rc, out


def _steps(db: Path) -> list[tuple[int, str, dict]]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT step, status, metrics_json FROM step ORDER BY step").fetchall()
    finally:
        con.close()
    return [(n, st, json.loads(m or "{}")) for n, st, m in rows]


@pytest.mark.timeout(1500)
def test_family_trains_through_the_gateway_with_exact_rows(trained):
    kind, db, rc, out = trained
    assert rc == 0, out[-6000:]
    steps = _steps(db)
    assert [(n, st) for n, st, _ in steps] == [(1, "completed"), (2, "completed")], out[-3000:]
    # A step's rollout statistics cover the groups that finished since the step before: with no
    # evaluation pause, step 2's batch can be whole before step 1 ends, and step 2 has none.
    assert any("rollout/accepted" in m for _, _, m in steps), steps
    for n, _, m in steps:
        assert m.get("rollout/accepted", 1.0) == 1.0, (kind, n, m)
        assert not {k: v for k, v in m.items() if "/rejected/" in k and v}, (kind, n, m)
    # A step's row statistics cover the episodes that finished since the previous step (an
    # asynchronous step may have none); every one recorded has no break and its screenshots.
    rows = [m for _, _, m in steps if "rollout/cua/prefix_breaks" in m]
    assert rows, steps
    for m in rows:
        assert m["rollout/cua/prefix_breaks"] == 0.0, (kind, m)
        assert m["rollout/cua/images"] >= 1.0 and m["rollout/cua/turns"] >= 1.0, (kind, m)
    first = steps[0][2]
    # Every trained token of step 1: |log p_trainer - log p_vLLM| <= TOL.
    for stat in ("min", "max"):
        gap = first[f"ppo_actor/update/behave_approx_kl/{stat}"]
        print(f"{kind}: step 1 behave_approx_kl/{stat} = {gap:.3g}")  # pytest -s reports it
        assert abs(gap) < TOL, (kind, stat, gap)
    assert first["ppo_actor/update/unclipped_behave_tokens"] > 0, (kind, first)
