"""An episode's steps as step credit needs them: each step's state key, action and tokens.

``episode_steps`` reads what every accepted episode has, fresh or replayed: its rows' token
layout (image pads), each row's image hashes, trained turns and the span of sampled tokens of
each (``ConversionResult.row_spans``, kept by the warehouse too), each turn's agent step and
actions, and the images' bytes: that is how every token finds its step in one row per call
(MAI-UI's window) and in one append-only row spanning every step alike. A record stored before
spans were kept gives none; then a row's runs of loss mask are taken as its turns in order,
which holds only where the runs and the turns agree in number (two turns' tokens can touch: a
re-asked call's prompt is the one before it with its reply), and the episode is refused
otherwise. The screenshot a step saw is the last image before its first turn's output.

Pure and synchronous (hashing screenshots takes milliseconds each: callers run it in a thread).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cua_rl.credit import keys
from cua_rl.credit.config import StateKeyConfig
from cua_rl.credit.keys import StateKey
from cua_rl.trajectory.events import PARSE_FAILURE_ACTIONS

NO_KEY = StateKey("", "")


class StepsError(ValueError):
    """An episode's rows and turns do not line up (its steps cannot be credited)."""


@dataclass(frozen=True)
class Step:
    """One agent step: the state it started from, what it did, where it led, its turns."""

    step: int  # the agent's step number (1-based)
    key: StateKey
    action: str  # the step's actions, canonical (name and arguments)
    next_key: StateKey | None  # the state after it (the next step's, or the gym's after-key)
    turns: tuple[int, ...]  # the turns (model calls) of the step the rows train


@dataclass(frozen=True)
class EpisodeSteps:
    """An episode's trained steps in order, and per row the token spans of each step:
    ``(start, end, step)`` in the row's own positions."""

    episode_id: int
    steps: tuple[Step, ...]
    spans: tuple[tuple[tuple[int, int, int], ...], ...]
    rollout_uuid: str = ""


def runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs of 1 in a 0/1 list, as (start, end)."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def action_signature(actions: Sequence[Mapping[str, Any]]) -> str:
    """What a step did, comparable across episodes: each action's name and arguments."""
    return json.dumps(
        [[a.get("name"), a.get("args") or {}] for a in actions], sort_keys=True, default=str
    )


def _tensor_list(value: Any) -> list[int]:
    return [int(v) for v in (value[0].tolist() if hasattr(value, "tolist") else value)]


def episode_steps(
    *,
    episode_id: int,
    rows: Sequence[Mapping[str, Any]],
    row_images: Sequence[Sequence[str]],
    row_turns: Sequence[Sequence[int]],
    turns: Mapping[int, tuple[int, Sequence[Mapping[str, Any]]]],
    images: Mapping[str, bytes],
    config: StateKeyConfig,
    rollout_uuid: str = "",
    row_spans: Sequence[Sequence[tuple[int, int, int]]] = (),
) -> EpisodeSteps:
    """The steps of one episode. ``rows``: each with ``loss_mask`` and ``mm_token_type_ids``
    (tensors ``[1, n]`` or lists); ``row_images``: each row's image hashes (sha256 hex, prompt
    order); ``row_turns``: each row's trained turn indices; ``turns``: turn index -> (agent step,
    actions); ``images``: hash -> bytes; ``row_spans``: each row's (start, end, turn) of sampled
    tokens (empty: the loss mask's runs). Raises ``StepsError`` when they do not line up."""
    if not (len(rows) == len(row_images) == len(row_turns)):
        raise StepsError(
            f"{len(rows)} rows, {len(row_images)} image lists, {len(row_turns)} turn lists"
        )
    if row_spans and len(row_spans) != len(rows):
        raise StepsError(f"{len(rows)} rows, {len(row_spans)} span lists")
    shown: dict[int, str | None] = {}  # turn -> the hash of the last image before its output
    spans: list[tuple[tuple[int, int, int], ...]] = []
    for r, (row, hashes, trained) in enumerate(zip(rows, row_images, row_turns, strict=True)):
        mask = _tensor_list(row["loss_mask"])
        pads = _tensor_list(row["mm_token_type_ids"])
        sampled = _sampled(r, mask, trained, row_spans[r] if row_spans else None)
        image_starts = [s for s, _ in runs(pads)]
        if len(image_starts) != len(hashes):
            raise StepsError(f"row {r}: {len(image_starts)} image pad runs, {len(hashes)} images")
        found = []
        for start, end, turn in sampled:
            if turn not in turns:
                raise StepsError(f"row {r} trains turn {turn}, which the episode does not have")
            before = sum(1 for s in image_starts if s < start)
            shown.setdefault(turn, hashes[before - 1] if before else None)
            found.append((start, end, turns[turn][0]))
        spans.append(tuple(found))
    return EpisodeSteps(
        episode_id=int(episode_id),
        steps=_steps(shown, turns, images, config),
        spans=tuple(spans),
        rollout_uuid=rollout_uuid,
    )


def _sampled(r: int, mask: list[int], trained, spans) -> list[tuple[int, int, int]]:
    """A row's (start, end, turn) of sampled tokens: its spans, checked against its loss mask,
    or (none kept) its runs of loss mask taken as its turns in order."""
    if spans:
        spans = [tuple(int(v) for v in span) for span in spans]
        if [t for _, _, t in spans] != list(trained):
            raise StepsError(f"row {r}: spans of turns {[t for *_, t in spans]}, trains {trained}")
        covered = [0] * len(mask)
        for start, end, _ in spans:
            # A call that sampled nothing has an empty span: its step has no tokens there.
            if not 0 <= start <= end <= len(mask):
                raise StepsError(f"row {r}: span {start}..{end} outside its {len(mask)} tokens")
            covered[start:end] = [1] * (end - start)
        if covered != [1 if m else 0 for m in mask]:
            raise StepsError(f"row {r}: its spans are not its sampled tokens")
        return spans
    sampled = runs(mask)
    if len(sampled) != len(trained):
        raise StepsError(
            f"row {r}: {len(sampled)} runs of sampled tokens for {len(trained)} trained turns "
            "(no spans kept)"
        )
    return [(s, e, t) for (s, e), t in zip(sampled, trained, strict=True)]


def _acted(actions: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a step sent anything to the device: a reply that did not parse sent nothing."""
    return any(str(a.get("name", "")).lower() not in PARSE_FAILURE_ACTIONS for a in actions)


def _gym_states(steps: list[list[Mapping]]) -> tuple[list, list]:
    """Each step's state before and after, by the gym's keys (None where unknown). A step that
    sent no action left the state as it found it, so its state is the previous action's
    after-key, or else the next action's before-key."""
    before, after, acted = [], [], []
    for actions in steps:
        results = [a.get("rawResult") for a in actions if isinstance(a.get("rawResult"), Mapping)]
        first = next((k for r in results if (k := keys.gym_key(r.get(keys.BEFORE_FIELD)))), None)
        last = next(
            (k for r in reversed(results) if (k := keys.gym_key(r.get(keys.AFTER_FIELD)))), None
        )
        moved = _acted(actions)
        state = first or (after[-1] if after else None)
        before.append(state)
        after.append(last or (state if not moved else None))
        acted.append(moved)
    for i in range(len(steps) - 2, -1, -1):
        if before[i] is None and not acted[i] and before[i + 1] is not None:
            before[i] = after[i] = before[i + 1]
    return before, after


def _steps(shown, turns, images, config: StateKeyConfig) -> tuple[Step, ...]:
    by_step: dict[int, list[int]] = {}
    for turn in sorted(shown):
        by_step.setdefault(turns[turn][0], []).append(turn)
    numbers = sorted(by_step)
    actions = [[a for t in by_step[n] for a in turns[t][1]] for n in numbers]
    before, after = _gym_states(actions)
    hashed: dict[str, StateKey] = {}
    out: list[Step] = []
    for i, step in enumerate(numbers):
        ids = tuple(by_step[step])
        key = _key(config.mode, before[i], shown[ids[0]], images, config, hashed)
        out.append(Step(step, key, action_signature(actions[i]), None, ids))
    # A step's next state, of its own key's kind: the gym's after-key, else the next step's key.
    linked = []
    for i, s in enumerate(out):
        nxt = out[i + 1].key if i + 1 < len(out) else None
        if s.key.kind == keys.GYM and after[i] is not None:
            nxt = after[i]
        if nxt is not None and nxt.kind != s.key.kind:
            nxt = None
        linked.append(Step(s.step, s.key, s.action, nxt, s.turns))
    return tuple(linked)


def _key(mode, gym: StateKey | None, digest, images, config, hashed) -> StateKey:
    if mode in ("auto", "gym") and gym is not None:
        return gym
    if mode == "gym" or digest is None or digest not in images:
        return NO_KEY
    if mode == "exact":
        return keys.exact_of(digest)
    if digest not in hashed:
        hashed[digest] = keys.phash_of(images[digest], config)
    return hashed[digest]
