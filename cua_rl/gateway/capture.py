"""What the gateway captured of one episode, and its conversion to the row builder's turns.

Every model call the agent made through the gateway leaves one :class:`CapturedTurn` with the ids
the model saw (as the server expanded them) and sampled, their logprobs, the version that sampled
each token, the images as the model received them, and what the agent asked for that the trainer
overrode. Calls the gateway refused leave an error instead, so the workflow can name the reason
when the agent's run then fails.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from cua_rl.gateway.render import Image
from cua_rl.trajectory.events import Turn

IMAGE_KEY_PREFIX = "sha256:"


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

    def token_fields(self) -> dict[str, Any]:
        """What the capture knows better than the agent's event log: a ``Turn``'s token data."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "output_logprobs": list(self.logprobs),
            "output_versions": list(self.versions),
            "finish_reason": self.finish_reason,
            "image_urls": self.image_keys(),
            "notes": self.notes(),
        }

    def notes(self) -> dict[str, Any]:
        notes: dict[str, Any] = {"versions": sorted(set(self.versions))}
        if self.overridden:
            notes["sampling_overridden"] = self.overridden
        for key in ("aborts", "retries", "cut"):
            if getattr(self, key):
                notes[key] = getattr(self, key)
        if self.tools:
            # The schema once per episode (where it first reached the prompt), names after.
            notes["tools"] = [t["function"]["name"] for t in self.tools]
            if self.tools_first_seen:
                notes["tools_schema"] = self.tools
        if calls := self.message.get("tool_calls"):
            notes["tool_calls"] = [c["function"]["name"] for c in calls]
        return notes

    def image_keys(self) -> list[str]:
        return [IMAGE_KEY_PREFIX + img.sha256 for img in self.images]


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
    resends: int = 0  # re-sends of an undelivered answer (joined or stored), never sampled again
    reasks: int = 0  # the last delivered call asked again: sampled again, a turn of its own
    disconnects: int = 0  # calls whose client left before the answer (nothing committed)
    discarded: int = 0  # generations no client received (never committed)
    fetches: int = 0  # image URLs fetched (once per distinct image, re-signed URLs included)
    # Model-server outages the episode's calls were held through (failed calls' included).
    outage_s: float = 0.0
    outage_retries: int = 0

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

    def images(self) -> dict[str, bytes]:
        """Every image of the episode by the key its turns use (what ``iter_images`` reads)."""
        return {IMAGE_KEY_PREFIX + img.sha256: img.data for t in self.turns for img in t.images}

    def _matches(self, event_turns: list[Turn]) -> list[tuple[CapturedTurn, Turn | None]]:
        """Each captured call with the agent's turn for it: by the response id the gateway gave
        the reply, or by position when the agent's events carry no ids."""
        by_id = {t.response_id: t for t in event_turns if t.response_id}
        if by_id:
            return [(c, by_id.get(c.response_id)) for c in self.turns]
        aligned = len(event_turns) == len(self.turns)
        return [(c, event_turns[c.index] if aligned else None) for c in self.turns]

    def row_turns(self, event_turns: list[Turn]) -> list[Turn]:
        """The row builder's turns: tokens, logprobs, versions and images as captured; actions
        from the agent's events (the only place actions live)."""
        out: list[Turn] = []
        for c, ev in self._matches(event_turns):
            out.append(
                Turn(
                    step=ev.step if ev else c.index + 1,
                    index=c.index,
                    messages=None,
                    text=c.text,
                    actions=list(ev.actions) if ev else [],
                    action_parsed=ev.action_parsed if ev else False,
                    action_ok=ev.action_ok if ev else False,
                    response_id=c.response_id,
                    **c.token_fields(),
                )
            )
        return out

    def monitor_turns(self, event_turns: list[Turn]) -> list[Turn]:
        """The agent's turns with the token data the gateway captured for them."""
        captured = {id(ev): c for c, ev in self._matches(event_turns) if ev is not None}
        out = []
        for ev in event_turns:
            c = captured.get(id(ev))
            if c is None:
                out.append(ev)
                continue
            out.append(replace(ev, missing=None, **c.token_fields()))
        return out
