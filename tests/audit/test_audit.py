"""The audit over a real local gym: planted faults found, clean tasks left alone, boxes bounded.

The planted tasks come from ``planted_tasks.yaml`` through the gym's task file: a task whose
starting state already passes, one whose validator reads a random number (seeded per test, so
which runs pass is known: its solution's three replays draw tails, tails, heads), one whose
validator reads the wrong field so the oracle's replay is rejected, and two clean ones.
"""

from __future__ import annotations

import pytest

from tests.audit.conftest import run_audit

PLANTED = ["user-free-start", "user-coin-flip", "user-wrong-field", "user-free-answer"]
PLANTED += ["user-clean-wifi", "user-clean-note"]


async def test_planted_faults_are_flagged_and_clean_tasks_are_not(gym, genv):
    audit, results = await run_audit(genv, PLANTED)
    verdicts = {t: r.verdict.verdict for t, r in results.items()}
    assert verdicts == {
        "user-free-start": "free_reward",
        "user-coin-flip": "flaky",
        "user-wrong-field": "rejects_success",
        "user-free-answer": "free_reward",
        "user-clean-wifi": "clean",
        "user-clean-note": "clean",
    }
    assert not results["user-clean-wifi"].verdict.flags
    assert not results["user-clean-note"].verdict.flags
    assert audit.executions()["open"] == 0
    assert gym.gym.live == {}


async def test_free_reward_names_the_agents_that_did_nothing_and_the_validator(gym, genv):
    _, results = await run_audit(genv, ["user-free-start"])
    flags = results["user-free-start"].verdict.flags
    by_agent = {f.agent: f for f in flags}
    assert {"stop", "wait"} <= set(by_agent)
    stop = by_agent["stop"]
    assert stop.kind == "free_reward"
    assert "3 of 3 runs" in stop.message
    assert stop.evidence["validators"] == [
        {"id": "wifi_on", "passed": True, "message": "wifi is True, want True"}
    ]
    assert stop.evidence["execution_id"].startswith("ex-")
    # Random taps that changed nothing on Settings are rewarded too; those that flipped the
    # switch (a state change) are not free reward.
    random_flags = [f for f in flags if f.agent == "random"]
    assert all(f.evidence["effect"] == "unchanged" for f in random_flags)


async def test_a_validator_reading_a_random_number_is_flaky_on_one_action_sequence(gym, genv):
    _, results = await run_audit(genv, ["user-coin-flip"])
    result = results["user-coin-flip"]
    (flag,) = result.verdict.flags
    assert flag.kind == "flaky" and flag.agent == "replay"
    # The seeded coin: tails, tails, heads, whichever replay drew which.
    assert sorted(flag.evidence["scores"]) == [0.0, 0.0, 1.0]
    replays = [r for r in result.runs if r.plan == "replay:solution"]
    assert sorted(r.score for r in replays) == [0.0, 0.0, 1.0]
    # Doing nothing never pays: the coin is only tossed once Wi-Fi is on.
    assert result.verdict.summary["stop"]["rewarded"] == 0


async def test_the_oracles_replay_rejected_by_a_wrong_validator(gym, genv):
    _, results = await run_audit(genv, ["user-wrong-field"])
    result = results["user-wrong-field"]
    (flag,) = result.verdict.flags
    assert flag.kind == "rejects_success"
    assert "bluetooth is False, want True" in flag.message
    # The replay did change the state: Settings opened, Wi-Fi switched on.
    replay = next(r for r in result.runs if r.plan == "replay:solution")
    assert replay.effects == ["changed", "changed"]


async def test_an_answer_that_pays_without_the_actions_is_free_reward(gym, genv):
    """The solution's answer at once, no action: the plain answer check pays half (the
    instruction gives the product away); sim-013 had this check before the audit found it."""
    _, results = await run_audit(genv, ["user-free-answer", "sim-013-calc-answer"])
    (flag,) = results["user-free-answer"].verdict.flags
    assert flag.kind == "free_reward" and flag.agent == "answer"
    assert "rewarded in 3 of 3 runs (score 0.5;" in flag.message
    assert flag.evidence["effect"] == "unchanged"
    fixed = results["sim-013-calc-answer"]
    assert fixed.verdict.verdict == "clean"
    assert fixed.verdict.summary["answer"] == {"runs": 3, "rewarded": 0, "errors": 0}


async def test_each_state_changing_step_of_a_replay_is_removed_once(gym, genv):
    _, results = await run_audit(genv, ["user-clean-note"])
    result = results["user-clean-note"]
    ablations = sorted({p.removed for p in result.plans if p.agent == "ablation"})
    # Notes opened, the editor opened, text typed, saved: four state changes, four removals.
    assert ablations == [0, 1, 2, 3]
    assert result.verdict.summary["ablation"] == {"runs": 12, "rewarded": 0, "errors": 0}


async def test_boxes_open_at_once_never_exceed_the_bound(gym, genv):
    audit, results = await run_audit(genv, PLANTED, concurrency=3)
    created = gym.gym.counters["created"]
    assert created == audit.executions()["created"] == sum(len(r.runs) for r in results.values())
    # Many more runs than the bound, all of them ready to go at once: the bound is reached,
    # never passed.
    assert gym.gym.counters["peak_live"] == 3
    assert gym.gym.counters["terminated"] == created
    assert gym.gym.live == {}


async def test_an_agent_the_config_leaves_out_does_not_run(gym, genv):
    _, results = await run_audit(genv, ["user-free-start"], agents=["wait"], repeats=2)
    result = results["user-free-start"]
    assert set(result.verdict.summary) == {"wait"}
    assert result.verdict.summary["wait"]["runs"] == 2
    assert result.verdict.verdict == "free_reward"


async def test_the_infeasible_claim_runs_only_where_the_task_reads_an_answer(gym, genv):
    _, results = await run_audit(genv, ["user-clean-wifi", "sim-013-calc-answer"])
    assert results["user-clean-wifi"].skipped["infeasible"] == "the task reads no answer"
    calc = results["sim-013-calc-answer"]
    assert calc.verdict.summary["infeasible"] == {"runs": 3, "rewarded": 0, "errors": 0}
    # The solution ends in finished("111"): the replay answers it.
    assert next(p for p in calc.plans if p.agent == "replay").answer == "111"


@pytest.mark.slow
async def test_the_shipped_phone_tasks_are_clean(gym, genv):
    """Every built-in phone task, every agent: nothing flagged (docs/gym.md reports it)."""
    tasks = [t["task_id"] for t in await genv.list_tasks() if t["task_id"].startswith("sim-")]
    # sim-001 to sim-022: the learn-long wizard (step credit's family) made 21 and 22.
    assert len(tasks) == 22, tasks
    audit, results = await run_audit(genv, tasks)
    flagged = {t: r.verdict.flags[0].message for t, r in results.items() if r.verdict.flags}
    assert flagged == {}
    assert all(r.verdict.verdict == "clean" for r in results.values())
    assert all(r.verdict.summary["replay"]["rewarded"] == 3 for r in results.values())
    assert audit.executions()["open"] == 0 and gym.gym.live == {}


async def test_a_gym_without_box_routes_gets_the_agents_that_need_none(gym):
    """A gym serving the genv routes only (no screenshot, no actions: the production genv's are
    not known here): stop and claim-infeasible still judge the task, the agents that act are
    n/a with the gym's answer, and every box they opened is terminated."""
    import httpx

    from cua_rl.clients.genv import GenvClient
    from tests.agent.conftest import FaultyTransport
    from tests.gym.conftest import FAST

    def no_box_routes(request: httpx.Request, _n: int):
        if request.url.path.endswith(("/screenshot", "/actions")):
            return lambda _real: httpx.Response(404, json={"detail": "Not Found"}, request=request)
        return None

    transport = FaultyTransport(no_box_routes)
    async with httpx.AsyncClient(transport=transport) as http:
        async with GenvClient(gym.url, gym.gym_id, client=http, timeouts=FAST) as genv:
            audit, results = await run_audit(genv, ["user-free-start", "user-coin-flip"])
    free, coin = results["user-free-start"], results["user-coin-flip"]
    assert free.verdict.verdict == "free_reward"  # stopping at once is enough to tell
    assert set(free.verdict.summary) == {"stop"}
    for agent in ("wait", "random", "replay"):
        assert free.skipped[agent].startswith("the gym serves no box routes"), free.skipped
    assert coin.verdict.summary["infeasible"]["runs"] == 3
    assert coin.verdict.verdict == "clean"
    assert transport.injected > 0 and gym.gym.live == {}
    assert audit.executions()["open"] == 0
