"""What one episode produced, and the per-episode stats AReaL aggregates.

The workflow fills an :class:`Episode` as it goes (execution, agent run, evaluation, reward, the
gateway's capture, the row) and its hooks read and extend it. ``episode_stats`` turns a finished
or rejected episode into the scalars logged under AReaL's rollout scope: AReaL averages them over
the episodes of a step, so counts are per episode and ``reward_sq`` lets the spread be derived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from cua_rl.agent.spec import RunResult
from cua_rl.clients.genv import EvaluationResult
from cua_rl.core import reasons
from cua_rl.gateway.capture import EpisodeCapture
from cua_rl.reward import RewardOutcome
from cua_rl.trajectory import ConversionResult
from cua_rl.trajectory.events import ParsedEvents

# Per episode (AReaL averages them over a step's episodes): the step's sampled and trained tokens
# say whether every call was trained; rows and processed images what it cost.
ROW_STATS = (
    "turns",
    "rows",
    "trained_turns",
    "dropped_turns",
    "sampled_tokens",
    "trained_tokens",
    "row_tokens",
    "images",
    "distinct_images",
    "processed_images",
    "prefix_breaks",
    "row_len",
)


@dataclass
class Episode:
    data: dict[str, Any]
    rollout_uuid: str
    version: int
    model_base_url: str = ""
    execution_id: str | None = None
    box_id: str | None = None
    run: RunResult | None = None
    evaluation: EvaluationResult | None = None
    parsed: ParsedEvents | None = None
    capture: EpisodeCapture | None = None  # what the gateway captured (gateway mode)
    reward: RewardOutcome | None = None
    conversion: ConversionResult | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return str(self.data["task_id"])

    def monitor_turns(self) -> list:
        """The agent's turns, with the gateway's token data where it captured the call, each
        noting whether a row trains it (known once the rows are built)."""
        turns = self.parsed.turns if self.parsed else []
        turns = self.capture.monitor_turns(turns) if self.capture else turns
        if self.conversion is None:
            return turns
        trained = self.conversion.trained_steps
        return [replace(t, notes={**t.notes, "trained": t.step in trained}) for t in turns]


class Phase:
    """``async with Phase(ep, "agent_s"):`` records the block's wall time in the episode."""

    def __init__(self, episode: Episode, name: str):
        self.episode, self.name = episode, name

    async def __aenter__(self):
        self.t0 = time.monotonic()

    async def __aexit__(self, *exc):
        self.episode.timings[self.name] = time.monotonic() - self.t0


def episode_stats(episode: Episode, reason: str | None) -> dict[str, float]:
    """One episode's scalars (``cua/...``); ``reason`` is its rejection reason, if rejected."""
    stats: dict[str, float] = {"cua/accepted": 0.0 if reason else 1.0}
    if reason:
        stats[f"cua/rejected/{reason}"] = 1.0
    if episode.reward is not None:
        stats["cua/reward"] = episode.reward.reward
        stats["cua/reward_sq"] = episode.reward.reward**2
        stats["cua/success"] = float(episode.reward.success)
    if episode.conversion is not None:
        for key in ROW_STATS:
            if key in episode.conversion.stats:
                stats[f"cua/{key}"] = float(episode.conversion.stats[key])
    if episode.capture is not None:
        stats.update({f"cua/{k}": v for k, v in episode.capture.stats().items()})
    for key, value in episode.timings.items():
        stats[f"cua/time/{key}"] = float(value)
    return stats


def gateway_reason(capture: EpisodeCapture | None, run_reason: str) -> str | None:
    """A sharper rejection reason than the agent's when the gateway knows why its run failed."""
    if capture is None:
        return None
    if capture.errors:
        return reasons.gateway_reason(capture.errors[-1].code)
    if not capture.turns and run_reason in ("model_error", "step_timeout", "timeout"):
        # The agent never got through: the advertised gateway URL is not reachable from it.
        return reasons.Reason.GATEWAY_UNREACHABLE
    return None
