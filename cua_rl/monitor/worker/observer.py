"""The monitor's observer of an episode: its rollout, environment, validation, turns and screenshots.

``MonitorObserver`` opens the episode's ``RolloutRecorder`` itself when the episode starts (the
monitor client is the worker's, per event loop; an episode the run never trains, or a run
without a monitor, is given none and records nothing) and turns each event into the records of
docs/monitor.md: the rollout's status, its environment, the gym's verdict, the turns with their
actions, token data and screenshots once the rows are built (whether a row trains each turn),
and the end. Screenshots are downscaled and kept by the monitor (presigned URLs expire): the
gateway's images, or those fetched from the agent's URLs under the trajectory's image policy.
Nothing here awaits the network or raises into training: the recorder only enqueues.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cua_rl.monitor.worker.client import MonitorClient
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.monitor.worker.uploader import Fetch, http_fetcher
from cua_rl.rollout.drain import DRAIN_REASON
from cua_rl.rollout.episode import (
    BoxChanged,
    Converted,
    Ended,
    EpisodeObserver,
    EpisodeTask,
    Evaluated,
    Started,
)
from cua_rl.rollout.placement import rollout_source
from cua_rl.rollout.settings import WorkflowSettings

MonitorFor = Callable[[], Awaitable[MonitorClient | None]]


def recorder_for(
    client: MonitorClient | None, settings: WorkflowSettings, task: EpisodeTask, is_eval: bool
) -> RolloutRecorder:
    """The episode's recorder on ``client`` (None: a recorder that records nothing), under the
    step, eval or baseline record its phase and policy version belong to."""
    s = settings
    return RolloutRecorder(
        client,
        task.rollout_uuid,
        task_id=task.task_id,
        model_path=s.processor_path,
        source=rollout_source(s.training_ref, s.phase, is_eval, task.version),
        task={
            "name": task.data.get("name") or task.task_id,
            "description": task.data.get("description") or "",
        },
    )


class MonitorObserver(EpisodeObserver):
    """See the module docstring. ``monitor``: the episode's monitor client (None when it is not
    recorded); ``http``: the client screenshots are fetched with in direct mode."""

    name = "monitor"

    def __init__(
        self,
        monitor: MonitorFor,
        settings: WorkflowSettings,
        task: EpisodeTask,
        is_eval: bool,
        http: Any,
    ):
        self.monitor, self.settings, self.task, self.is_eval = monitor, settings, task, is_eval
        self.recorder = recorder_for(None, settings, task, is_eval)  # until the episode starts
        self.fetch: Fetch = http_fetcher(settings.trajectory, http)

    async def started(self, event: Started) -> None:
        client = await self.monitor()
        self.recorder = recorder_for(client, self.settings, self.task, self.is_eval)
        await self.recorder.start()

    async def box_changed(self, event: BoxChanged) -> None:
        r = self.recorder
        if event.state == "running":
            await r.environment("running", gbox_id=event.box.box_id)
        elif event.state == "error" or event.cancelled:
            message = event.message if event.state == "error" else DRAIN_REASON
            await r.environment(event.state, status_message=message)
        else:
            await r.environment(event.state)

    async def evaluated(self, event: Evaluated) -> None:
        await self.recorder.validation(
            success=event.reward.success,
            score=event.reward.base,
            details_json=event.evaluation.raw,
        )

    async def converted(self, event: Converted) -> None:
        if self.recorder.enabled:
            turns = event.calls.monitor_turns(event.rows.trained_steps)
            await self.recorder.record_turns(turns, images=event.calls.images(), fetch=self.fetch)

    async def ended(self, event: Ended) -> None:
        r = self.recorder
        if event.accepted:
            await r.complete(
                reward=event.reward.reward,
                task_success=int(event.reward.success),
                metrics_json={"conversion": event.rows.stats, "timings": dict(event.timings)},
            )
        elif event.outcome == "cancelled":
            await r.fail("cancelled", status_message=DRAIN_REASON)
        else:
            await r.fail(event.reason, error_message=str(event.error))
