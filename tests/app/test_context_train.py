"""Every call trains, whatever the agent keeps in its context and whoever runs its loop: the
session's shared trainings (tests/conftest.py ``REGIMES``), one per context policy of the local
agent (docs/agent.md), on the local agent service and in the rollout workers themselves
(``agent.mode: builtin``, no agent service).

``make demo``'s launcher in three regimes: the demo's own (the agent service keeping the whole
conversation, production's asynchronous regime, six steps with an evaluation after each), the
built-in loop building its requests as MAI-UI's agent does (a window of 3 screenshots, history
re-rendered from the parsed action) and the agent service sending the current screenshot only
(three steps each, one step of staleness: at most two steps' episodes start before the first
weight update, so a third step's are sampled by a later version whatever the machine's speed).
The demo's run is where weight updates land inside episodes: its evaluation after each step
pauses the episodes in flight, which go on with the new weights. Expected values come from the
run's own records of what was sampled (the step stats AReaL logged, the monitor's turns) and from
the trainer's transformers forward (AReaL's ``behave_approx_kl``), never from the row builder.
The actor runs with its defaults: each distinct screenshot of a micro-batch through the vision
tower once, an episode's rows packed together.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import BUILTIN_MAI_UI, DEMO, SERVICE_CURRENT, db_rows

pytestmark = pytest.mark.slow

TOL = 1e-3

# (regime, agent mode, context policy)
RUNS = [(DEMO, "service", "full"), (BUILTIN_MAI_UI, "builtin", "mai-ui"),
        (SERVICE_CURRENT, "service", "current")]  # fmt: skip


@pytest.fixture(scope="module", params=RUNS, ids=[r.name for r, _, _ in RUNS])
def trained(request, shared_training):
    regime, mode, policy = request.param
    run = shared_training(regime.name)
    run_dir = run.run_dir
    if mode == "builtin":
        # No agent service was started: the rollout workers ran every episode's loop.
        assert "[demo] agent    builtin" in run.output, run.output[-3000:]
        assert "agent.log" not in {p.name for p in (run_dir / "logs").iterdir()}
    return policy, regime, run


@pytest.mark.timeout(1600)
def test_every_call_is_trained_once_with_exact_logprobs(trained):
    policy, regime, run = trained
    n_steps = regime.steps
    assert run.returncode == 0, run.output[-6000:]
    db = run.db
    steps = db_rows(db, "SELECT step, status, metrics_json FROM step ORDER BY step")
    assert [(n, st) for n, st, _ in steps] == [(n, "completed") for n in range(1, n_steps + 1)]
    stats = [json.loads(m or "{}") for _, _, m in steps]
    # A step's rollout statistics cover the groups that finished since the step before (a step
    # whose batch was whole before the previous one ended has none).
    assert any("rollout/accepted" in m for m in stats), stats
    for n, m in enumerate(stats, 1):
        assert m.get("rollout/accepted", 1.0) == 1.0, (policy, n, m)
        assert not {k: v for k, v in m.items() if "/rejected/" in k and v}, (policy, n, m)
    # A step's row statistics cover the episodes that finished since the previous step.
    rows = [m for m in stats if "rollout/cua/sampled_tokens" in m]
    assert rows, stats
    for m in rows:
        # Means per episode: every sampled token trained, no turn dropped.
        assert m["rollout/cua/trained_tokens"] == pytest.approx(m["rollout/cua/sampled_tokens"])
        assert m["rollout/cua/dropped_turns"] == 0.0
        assert m["rollout/cua/trained_turns"] == pytest.approx(m["rollout/cua/turns"])
    # Each step re-renders its history, so the prefix breaks at every step after the first and
    # each break starts a row; an append-only conversation is one row. (A step's re-ask of a
    # reply that did not parse sends the identical request: after a reply of no tokens it
    # extends that call and shares its row, so rows can be fewer than calls; per episode the
    # monitor test below checks a row per step.)
    multi = [m for m in rows if m["rollout/cua/turns"] > 1.0]
    assert multi, rows
    for m in multi:
        if policy == "full":
            assert m["rollout/cua/rows"] == 1.0, (policy, m)
        else:
            assert m["rollout/cua/rows"] == pytest.approx(m["rollout/cua/prefix_breaks"] + 1)
            assert 1.0 < m["rollout/cua/rows"] <= m["rollout/cua/turns"], (policy, m)
    # The actor's vision tower encoded each distinct screenshot of a micro-batch once
    # (docs/vision.md): a MAI-UI episode's rows share screenshots.
    vision = [m for m in stats if m.get("cua_vision/row_images")]
    assert vision, stats
    for m in vision:
        assert m["cua_vision/encoded_images"] == m["cua_vision/distinct_images"], (policy, m)
    if policy == "mai-ui":
        assert sum(m["cua_vision/row_images"] - m["cua_vision/encoded_images"] for m in vision)
    # Step 1's tokens were all sampled by version 0, the weights the trainer then held: its
    # transformers forward reproduces vLLM's logprob of every trained token, in every row.
    first = stats[0]
    for stat in ("min", "max"):
        assert abs(first[f"ppo_actor/update/behave_approx_kl/{stat}"]) < TOL, (policy, first)
    assert first["ppo_actor/update/unclipped_behave_tokens"] > 0


@pytest.mark.timeout(1600)
def test_the_monitor_marks_every_turn_trained_in_an_asynchronous_run(trained):
    policy, regime, run = trained
    assert run.returncode == 0, run.output[-6000:]
    turns = db_rows(
        run.db,
        "SELECT r.id, t.metrics_json FROM turn t JOIN rollout r ON t.rollout_id = r.id "
        "WHERE r.source_type = 'step' AND r.status = 'completed'",
    )
    assert turns
    versions: set[int] = set()
    per_episode: dict[int, set[int]] = {}
    for rid, mj in turns:
        m = json.loads(mj or "{}")
        assert m.get("trained") is True, (policy, rid, m)
        versions.update(m.get("versions", []))
        per_episode.setdefault(rid, set()).update(m.get("versions", []))
    # Asynchronous: the rollouts were sampled by several policy versions, and a step trained
    # samples of an older version than the one it updated (AReaL's staleness).
    assert len(versions) >= 2, versions
    if regime is DEMO:
        # The demo's run: weight updates landed inside episodes (the evaluation after each step
        # paused the episodes in flight): their turns carry several versions, and (above) none
        # of them was lost.
        assert any(len(v) > 1 for v in per_episode.values()), per_episode
    stale = [
        json.loads(m or "{}").get("ppo_actor/update/version_stats/sample_staleness_theta_max", 0)
        for (m,) in db_rows(run.db, "SELECT metrics_json FROM step")
    ]
    assert max(stale) >= 1, stale
    # Each rollout's conversion stats (kept with its extra fields: the rollout table has no
    # metrics column): every sampled token of every completed episode trained, a row per call.
    found = db_rows(
        run.db,
        "SELECT e.fields_json, (SELECT COUNT(*) FROM turn t WHERE t.rollout_id = r.id) "
        "FROM extra_field e JOIN rollout r ON e.entity_type = 'rollout' "
        "AND e.entity_id = r.id WHERE r.source_type = 'step' AND r.status = 'completed'",
    )
    conv = [(json.loads(fields)["metrics_json"]["conversion"], steps) for fields, steps in found]
    assert conv and all(c["trained_tokens"] == c["sampled_tokens"] for c, _ in conv), conv[:3]
    # A row per step (the monitor's turns are the agent's steps), at most one per model call.
    for c, steps in conv:
        if policy == "full":
            assert c["rows"] == 1, c
        else:
            assert steps <= c["rows"] <= c["turns"], (steps, c)


def test_an_eval_rollout_worker_runs_only_where_there_is_something_to_evaluate(trained):
    # AReaL starts one whether or not the gym gives eval tasks; the trainer (cua_rl/areal/actor.py)
    # does not where it gives none: the demo's run evaluates, the other two have no eval task.
    _, regime, run = trained
    assert run.returncode == 0, run.output[-6000:]
    (main_log,) = (run.run_dir / "areal" / "logs").rglob("main.log")
    roles = re.findall(
        r"Creating \d+ workers for role '([\w-]+)'", main_log.read_text(errors="replace")
    )
    evaluates = regime is DEMO
    assert roles == ["actor", "rollout", *(["eval-rollout"] if evaluates else [])], roles
    evals = db_rows(run.db, "SELECT COUNT(*) FROM eval")[0][0]
    assert (evals > 0) == evaluates, evals


@pytest.mark.timeout(1600)
def test_the_rollout_worker_forks_from_the_zygote_also_where_it_borrows_a_server(trained):
    # The trainer gives the rollout workers the server to borrow (CUA_INFERENCE_SERVER), not
    # the actor: a variable read when the worker launches, so the fork takes it.
    _, regime, run = trained
    assert run.returncode == 0, run.output[-6000:]
    # The demo's run starts its own zygote; the others' workers fork from the pytest
    # process's (tests/conftest.py warm_env), which imported their modules for all of them.
    train_log = (run.run_dir / "logs" / "train.log").read_text(errors="replace")
    given = "[warm-start] workers start from the zygote at " in train_log
    own = "[warm-start] zygote imported" in train_log
    assert (own, given) == ((True, False) if regime is DEMO else (False, True)), regime.name
    for role in ("actor", "rollout"):
        (log,) = (run.run_dir / "areal" / "logs").rglob(f"{role}.log")
        text = log.read_text(errors="replace")
        said = [x for x in text.splitlines() if x.startswith("[warm-start]")]
        forked = [x for x in said if x.startswith("[warm-start] worker forked from the zygote")]
        # The rollout worker's log also holds the eval rollout worker's line, where there is
        # one (the demo's run): it starts cold (app/test_train_local.py).
        assert len(forked) == 1 and len(said) == 1 + (role == "rollout" and regime is DEMO), (
            role, said,
        )  # fmt: skip
        if role == "rollout":
            assert bool(regime.borrows) == ("Borrowed the inference server at" in text), regime
