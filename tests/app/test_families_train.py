"""Each production family trained for real on the local stack: ``make demo``'s launcher with the
family's tiny model (its own template and processor), vLLM CPU serving it through the gateway
(the session's shared server for that model, borrowed; Qwen3-VL-MoE's own), AReaL's FSDP actor with selective
logits, one asynchronous PPO step (every task trains, none evaluates, no settle time). Qwen2.5-VL
trains a second time with ``logits.selective=false`` (AReaL's own actor, ``CuaPPOActor``): its
image-position fix must not depend on the selective-logits switch.

One training per family serves every check, and what they check is step 1's, so the run stops
there (``total_train_steps=1``): it completes with no episode rejected, no turn breaks the
multi-turn prefix, rows carry their screenshots, and at step 1 (every trained token sampled by
version 0, the weights the trainer holds) the trainer's own transformers forward reproduces
vLLM's logprob of every trained token within 1e-3: AReaL records the extremes of
log(trainer / vLLM) over the batch's tokens as ``behave_approx_kl``.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from cua_rl.testing.cache import FAMILY_KINDS
from tests.conftest import NO_EVAL, NO_LATENCY, run_demo

TOL = 1e-3

pytestmark = pytest.mark.slow


# (kind, extra overrides): each family on the default actor, and Qwen2.5-VL (the family whose
# positions the trainer fixes) on AReaL's unpatched-logits actor too, right after its first run
# (they borrow one server).
CASES = [
    (kind, extra)
    for kind in FAMILY_KINDS
    for extra in [(), *([("logits.selective=false",)] if kind == "qwen2.5-vl" else [])]
]
ONE_STEP = ("total_train_steps=1", "total_train_epochs=1")
# Qwen3-VL-MoE starts a server of its own: vLLM CPU's in-place reload of its fused experts, which
# a borrowed server does to load the training's initial weights, does not give back the weights
# of the first load (the same checkpoint answers other tokens after it; found by this test in
# issue 51, left to its own issue), so a borrowed MoE server would not serve version 0.
OWN_SERVER = {"qwen3-vl-moe"}


def _train(run_dir: Path, kind: str, overrides: tuple[str, ...], server) -> tuple[int, str, float]:
    t0 = time.monotonic()
    run = run_demo(
        run_dir, "--model", kind, *NO_LATENCY, *NO_EVAL, *ONE_STEP, *overrides,
        server=server, timeout=1200, name=f"family {kind}{' '.join(overrides)}",
    )  # fmt: skip
    rc, out = run.returncode, run.output
    return rc, out, time.monotonic() - t0


def _case_id(case: tuple[str, tuple[str, ...]]) -> str:
    kind, overrides = case
    return kind + ("-full-logits" if "logits.selective=false" in overrides else "")


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def trained(request, tmp_path_factory, model_servers):
    kind, overrides = request.param
    name = _case_id(request.param)
    run_dir = tmp_path_factory.mktemp(name) / "run"
    server = None if kind in OWN_SERVER else model_servers(kind)
    rc, out, seconds = _train(run_dir, kind, overrides, server)
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
    assert [(n, st) for n, st, _ in steps] == [(1, "completed")], out[-3000:]
    assert "rollout/accepted" in steps[0][2], steps
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
