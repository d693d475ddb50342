"""What the gateway captured of one episode: data, handed over when the episode's session closes.

Every model call the agent made through the gateway leaves one :class:`CapturedTurn` with the ids
the model saw (as the server expanded them) and sampled, their logprobs, the version that sampled
each token, the images as the model received them, and what the agent asked for that the trainer
overrode. Calls the gateway refused leave an error instead, so the episode can name the reason
when the agent's run then fails. ``stats`` counts the episode's calls; the session freezes them
in ``counters`` when it closes. Turning a capture into the row builder's turns is the
trajectory's job (``cua_rl.trajectory.captured``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cua_rl.gateway.render import Image


@dataclass
class CapturedTurn:
    index: int
    response_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    images: list[Image]
    segment: int
    extended: bool  # the server's prompt began with the conversation so far
    backend: str = "vllm"  # the request's shape (cua_rl.gateway.backends); "text": text in
    asked: dict[str, Any] = field(default_factory=dict)  # the agent's sampling settings
    overridden: dict[str, Any] = field(default_factory=dict)  # those the trainer replaced
    aborts: int = 0
    retries: int = 0
    outage_s: float = 0.0
    cut: int = 0
    paused_s: float = 0.0
    seconds: float = 0.0
    server: str = ""
    # The answer's message as the agent got it: content, and the tool calls parsed from ``text``.
    message: dict[str, Any] = field(default_factory=dict)
    tools: list | None = None  # the function schemas the prompt rendered
    tools_first_seen: bool = False  # the first turn of the episode with these tools
    top: list = field(default_factory=list)  # per token: the server's top (id, logprob)

    def __post_init__(self):
        if not self.message:
            self.message = {"role": "assistant", "content": self.text}


@dataclass
class GatewayError:
    code: str
    message: str
    status: int


@dataclass
class EpisodeCapture:
    episode_id: str
    opened_at: float = field(default_factory=time.time)
    turns: list[CapturedTurn] = field(default_factory=list)
    errors: list[GatewayError] = field(default_factory=list)
    # Requests for the episode that reached the gateway, answered or not: the agent reached it.
    received: int = 0
    resends: int = 0  # re-sends of an undelivered answer (joined or stored), never sampled again
    reasks: int = 0  # the last delivered call asked again: sampled again, a turn of its own
    disconnects: int = 0  # calls whose client left before the answer (nothing committed)
    discarded: int = 0  # generations no client received (never committed)
    fetches: int = 0  # image URLs fetched (once per distinct image, re-signed URLs included)
    # Model-server outages the episode's calls were held through (failed calls' included).
    outage_s: float = 0.0
    outage_retries: int = 0
    # ``stats()`` as of the session's close: what the rollout reads of the episode's calls.
    counters: dict[str, float] = field(default_factory=dict)

    def stats(self) -> dict[str, float]:
        """Per-episode counters for AReaL's stats (means across episodes)."""
        turns = self.turns
        versions = {v for t in turns for v in t.versions}
        return {
            "gateway/calls": float(len(turns)),
            "gateway/errors": float(len(self.errors)),
            "gateway/aborts": float(sum(t.aborts for t in turns)),
            "gateway/retries": float(sum(t.retries for t in turns)),
            "gateway/vision_token_stops": float(sum(t.cut for t in turns)),
            "gateway/paused_s": float(sum(t.paused_s for t in turns)),
            "gateway/outage_s": float(self.outage_s),
            "gateway/outage_retries": float(self.outage_retries),
            "gateway/overridden_calls": float(sum(1 for t in turns if t.overridden)),
            "gateway/versions_per_episode": float(len(versions)),
            "gateway/segments": float(max((t.segment for t in turns), default=0)),
            # Calls whose messages did not extend the conversation served (the agent rewrote or
            # truncated its history): each starts a new segment, a prefix break in the row.
            "gateway/new_segments": float(
                sum(1 for a, b in zip(turns, turns[1:], strict=False) if b.segment != a.segment)
            ),
            "gateway/not_extended": float(sum(1 for t in turns if not t.extended)),
            "gateway/text_in_calls": float(sum(1 for t in turns if t.backend == "text")),
            # An SDK re-sends the identical request after its own timeout: answered from the
            # call already running or answered, never sampled twice or taken for an edit.
            "gateway/resends": float(self.resends),
            # An agent asks the same request again when a reply did not parse: a new call,
            # sampled and trained like any other.
            "gateway/reasks": float(self.reasks),
            "gateway/disconnects": float(self.disconnects),
            "gateway/discarded_generations": float(self.discarded),
            "gateway/image_fetches": float(self.fetches),
        }
