"""Each production family trained for real on the local stack: ``make demo``'s launcher with the
family's tiny model (its own template and processor), vLLM CPU serving it through the gateway
(the session's shared server for that model, borrowed; Qwen3-VL-MoE's own), AReaL's FSDP actor with selective
logits, one asynchronous PPO step (every task trains, none evaluates, no settle time).

AReaL's own logits path (``logits.selective=false``) has no training here: that the Qwen2.5-VL
image-position fix reaches its worker is tests/areal/test_actor_positions.py's check (the worker's
engine class imported in a fresh interpreter, the switch on and off), and that it gives the
selective path's log-probabilities, gradients and statistics is tests/areal/test_selective_logits.py's;
the selective path is checked against vLLM here.

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


ONE_STEP = ("total_train_steps=1", "total_train_epochs=1")
# Qwen3-VL-MoE starts a server of its own: vLLM CPU's in-place reload of its fused experts, which
# a borrowed server does to load the training's initial weights, does not give back the weights
# of the first load (the same checkpoint answers other tokens after it; found by this test in
# issue 51, left to its own issue), so a borrowed MoE server would not serve version 0.
OWN_SERVER = {"qwen3-vl-moe"}


def _train(run_dir: Path, kind: str, server, env: dict[str, str]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    run = run_demo(
        run_dir, "--model", kind, *NO_LATENCY, *NO_EVAL, *ONE_STEP,
        server=server, timeout=1200, name=f"family {kind}", env=env,
    )  # fmt: skip
    rc, out = run.returncode, run.output
    return rc, out, time.monotonic() - t0


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def trained(request, tmp_path_factory, model_servers, warm_env):
    kind = request.param
    run_dir = tmp_path_factory.mktemp(kind) / "run"
    server = None if kind in OWN_SERVER else model_servers(kind)
    rc, out, seconds = _train(run_dir, kind, server, warm_env)
    print(f"{kind}: trained in {seconds:.0f}s")  # pytest -s shows each family's cost
    return kind, run_dir / "monitor.db", rc, out


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
