"""Where an episode's steps come from: the workflow's observers put each accepted train
episode's steps (read from its real conversion) in its runtime's ledger, which the group filter
reads; replay keeps a success's steps with it."""

from __future__ import annotations

from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.ledger import CreditLedger
from cua_rl.credit.observer import CreditObserver
from cua_rl.rollout.episode import CapturedCalls, Converted, EpisodeTask
from cua_rl.rollout.groups import GroupSettings
from cua_rl.rollout.runtime import RolloutRuntime
from cua_rl.rollout.settings import GymSection
from cua_rl.rollout.workflow import CUAAgentWorkflow
from cua_rl.trajectory.rows import ConversionResult
from tests.app.conftest import bare_settings
from tests.warehouse.conftest import converted

TASK = EpisodeTask({"task_id": "sim-021-learn-long-setup-trap2"}, "uuid-1", 3)


def _workflow(enabled: bool, phase: str = "train") -> CUAAgentWorkflow:
    settings = bare_settings(
        phase=phase,
        # Nothing listens there: the observers are only built, never called.
        gym=GymSection(base_url="http://127.0.0.1:9", gym_id="sim"),
        group=GroupSettings(size=2, step_credit=StepCreditConfig(enabled=enabled)),
    )
    return CUAAgentWorkflow(settings, runtime=RolloutRuntime(settings))


async def test_the_workflow_observes_steps_only_with_step_credit_on_in_training():
    # On the loop an episode runs on: the observers take the runtime's clients of that loop.
    class Engine:  # the pause observer keeps its server choice, never called here
        def choose_server(self):
            raise AssertionError("not called")

    def kinds(workflow):
        scope = workflow.runtime.episode(
            TASK,
            Engine(),
            is_eval=False,
            stat_scope="rollout",
            processor=lambda: None,
            model_name="m",
        )
        return [type(o).__name__ for o in workflow.observers(scope)]

    assert "CreditObserver" in kinds(_workflow(True))
    assert "CreditObserver" not in kinds(_workflow(False))
    assert "CreditObserver" not in kinds(_workflow(True, phase="eval"))


async def test_an_accepted_episode_leaves_its_steps_in_the_ledger(images, processor):
    turns, result = converted(images, processor, break_prefix=True)
    ledger = CreditLedger()
    observer = CreditObserver(ledger, StepCreditConfig(enabled=True), TASK, "rollout")
    await observer.on(Converted(CapturedCalls(turns), result))
    steps = ledger.peek(TASK.episode_id)
    assert steps is not None and steps.rollout_uuid == "uuid-1"
    assert [s.step for s in steps.steps] == [1, 2]
    assert steps.spans == tuple(
        tuple((a, b, turns[t].step) for a, b, t in row) for row in result.row_spans
    )
    # A rejected conversion leaves nothing, and a failure to read the steps is not the episode's.
    other = EpisodeTask({"task_id": "t"}, "uuid-2", 3)
    await CreditObserver(ledger, StepCreditConfig(enabled=True), other, "rollout").on(
        Converted(CapturedCalls(turns), ConversionResult(None, "no_turns"))
    )
    broken = ConversionResult(result.rows, None, row_images=[], row_turns=[])
    await CreditObserver(ledger, StepCreditConfig(enabled=True), other, "rollout").on(
        Converted(CapturedCalls(turns), broken)
    )
    assert ledger.peek(other.episode_id) is None and len(ledger) == 1


def test_the_ledger_keeps_the_newest_episodes():
    from cua_rl.credit.steps import EpisodeSteps

    ledger = CreditLedger(max_episodes=2)
    for eid in (1, 2, 3):
        ledger.put(EpisodeSteps(eid, (), ()))
    assert ledger.peek(1) is None and ledger.take(2) is not None and ledger.take(2) is None
    assert ledger.dropped == 1
