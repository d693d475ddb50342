"""Turns -> one AReaL training row, merged only where the multi-turn prefix property holds.

The row is built from the ids the model saw and sampled (docs/design.md, decision 1). Turn t
joins the running row when its prompt ids start with the row so far (turn t-1's prompt +
output); then the row becomes turn t's prompt + output, and every earlier turn's output keeps its
position, so its loss mask, logprobs and version can be laid on the final ids. The row's keys,
dtypes and shapes are the contract in ``cua_rl.core.row``, checked before a row is returned. When the property breaks, the break
is counted and a new segment starts; the config then trains the last segment or rejects the
episode, so a row never mixes contexts. The images of the row are those of its last prompt (an
append-only history carries every earlier screenshot); their pad-token runs in the prompt ids must
match what the processor computes per image, or the episode is rejected.

``convert_turns`` is pure (no network): http(s) images arrive as bytes from
:func:`cua_rl.trajectory.images.fetch_images`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cua_rl.core.reasons import Reason
from cua_rl.core.row import validate_row
from cua_rl.errors import RejectedEpisode
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.trajectory.events import Turn
from cua_rl.trajectory.images import (
    image_token_ids,
    iter_images,
    load_images,
    process_images,
    tokenizer_of,
)


@dataclass
class Segment:
    """Consecutive turns whose prompts extend each other; ``ids`` is the last prompt + output."""

    turns: list[Turn]
    ids: list[int]
    # (start, end, turn) spans of generated tokens within ``ids``
    spans: list[tuple[int, int, Turn]] = field(default_factory=list)


@dataclass
class ConversionResult:
    """A row, or the reason there is none; ``stats`` is filled in both cases as far as known."""

    row: dict[str, Any] | None
    reason: str | None = None
    detail: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.row is not None

    def raise_if_rejected(self) -> dict[str, Any]:
        if self.row is None:
            raise RejectedEpisode(self.reason or Reason.REJECTED, self.detail)
        return self.row


def split_segments(turns: Sequence[Turn]) -> tuple[list[Segment], int]:
    """Group turns into prefix-consistent segments; returns (segments, number of breaks)."""
    segments: list[Segment] = []
    breaks = 0
    for turn in turns:
        prompt, out = turn.prompt_ids, turn.output_ids
        if prompt is None or out is None:
            raise ValueError("split_segments needs turns with prompt and output ids")
        cur = segments[-1] if segments else None
        if cur is not None and prompt[: len(cur.ids)] == cur.ids:
            cur.turns.append(turn)
        else:
            if cur is not None:
                breaks += 1
            cur = Segment(turns=[turn], ids=[])
            segments.append(cur)
        cur.spans.append((len(prompt), len(prompt) + len(out), turn))
        cur.ids = list(prompt) + list(out)
    return segments, breaks


def pad_runs(ids: Sequence[int], token_id: int) -> list[int]:
    """Lengths of the maximal runs of ``token_id`` in ``ids``, in order."""
    runs: list[int] = []
    n = 0
    for t in ids:
        if t == token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    return runs


def _retokenize(turn: Turn, processor, images) -> None:
    """Fallback for a turn without token data: rebuild ids from its request (logprobs are 0).

    Only reachable when the config says the trainer recomputes logprobs (validated there).
    """
    if not turn.messages:
        raise RejectedEpisode(Reason.MISSING_TOKENS, f"turn {turn.index}: no request to retokenize")
    tok = tokenizer_of(processor)
    text = processor.apply_chat_template(turn.messages, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    turn.prompt_ids = [int(t) for t in enc["input_ids"][0].tolist()]
    out = tok.encode(turn.text or "", add_special_tokens=False)
    if turn.finish_reason == "stop" and tok.eos_token_id is not None:
        out = out + [tok.eos_token_id]
    if not out:
        raise RejectedEpisode(
            Reason.MISSING_TOKENS, f"turn {turn.index}: no reply text to retokenize"
        )
    turn.output_ids = [int(t) for t in out]
    turn.output_logprobs = [0.0] * len(out)


def convert_turns(
    turns: Sequence[Turn],
    *,
    processor,
    reward: float,
    version: int | Sequence[int],
    config: TrajectoryConfig | None = None,
    fetched_images: Mapping[str, bytes] | None = None,
) -> ConversionResult:
    """Build the training row of one episode; never raises for bad episode data.

    ``version`` is the engine's policy version for generated tokens: one int, or one per turn;
    a turn's own ``output_versions`` (one per token) take precedence.
    ``fetched_images`` maps the http(s) image URLs to their bytes (see ``fetch_images``).
    """
    config = config or TrajectoryConfig()
    stats: dict[str, Any] = {
        "turns": len(turns),
        "prefix_breaks": 0,
        "segments": 0,
        "trained_turns": 0,
        "row_len": 0,
        "trained_tokens": 0,
        "images": 0,
        "retokenized_turns": 0,
    }
    try:
        row = _convert(turns, processor, reward, version, config, fetched_images or {}, stats)
    except RejectedEpisode as exc:
        return ConversionResult(None, exc.reason, exc.detail, stats)
    return ConversionResult(row, None, "", stats)


def _convert(turns, processor, reward, version, config, fetched, stats) -> dict[str, Any]:
    if not turns:
        raise RejectedEpisode(Reason.NO_TURNS, "the event log has no completed model call")
    if isinstance(version, int):
        versions_per_turn = [version] * len(turns)
    else:
        versions_per_turn = [int(v) for v in version]
        if len(versions_per_turn) != len(turns):
            raise ValueError(f"{len(versions_per_turn)} versions for {len(turns)} turns")
    missing = [t for t in turns if t.missing]
    if missing and config.missing_tokens_policy == "reject":
        t = missing[0]
        raise RejectedEpisode(
            Reason.MISSING_TOKENS,
            f"{len(missing)} turn(s) lack token data (turn {t.index}: {t.missing}); the agent "
            "must request logprobs and return_token_ids",
        )
    turns = list(turns)
    for i, t in enumerate(turns):
        if t.missing:
            # A copy: the caller's turns keep showing what the log really held.
            turns[i] = t = replace(t, actions=list(t.actions), errors=list(t.errors))
            _retokenize(t, processor, load_images(t.image_urls, fetched, config))
            stats["retokenized_turns"] += 1
    version_of = {id(t): v for t, v in zip(turns, versions_per_turn, strict=True)}

    segments, breaks = split_segments(turns)
    stats["prefix_breaks"] = breaks
    stats["segments"] = len(segments)
    if breaks and config.prefix_break_policy == "reject":
        raise RejectedEpisode(
            Reason.PREFIX_BREAK, f"{breaks} prefix break(s) in {len(turns)} turns"
        )
    seg = segments[-1]
    last = seg.turns[-1]
    ids = seg.ids
    prompt_len = len(last.prompt_ids)
    stats["trained_turns"] = len(seg.turns)
    stats["row_len"] = len(ids)
    if config.max_row_tokens and len(ids) > config.max_row_tokens:
        raise RejectedEpisode(Reason.ROW_TOO_LONG, f"{len(ids)} tokens > {config.max_row_tokens}")

    image_id, video_id = image_token_ids(processor)
    for start, end, _ in seg.spans:
        sampled = ids[start:end]
        if image_id in sampled or (video_id is not None and video_id in sampled):
            raise RejectedEpisode(
                Reason.IMAGE_TOKEN_IN_OUTPUT, "the model sampled an image/video pad token"
            )
    if video_id is not None and video_id in ids[:prompt_len]:
        raise RejectedEpisode(Reason.VIDEO_UNSUPPORTED, "the prompt holds video tokens")

    urls = last.image_urls
    if len(urls) > config.max_images:
        raise RejectedEpisode(
            Reason.TOO_MANY_IMAGES, f"{len(urls)} images > max_images {config.max_images}"
        )
    runs = pad_runs(ids[:prompt_len], image_id)
    if len(runs) != len(urls):
        raise RejectedEpisode(
            Reason.IMAGE_COUNT_MISMATCH,
            f"prompt ids hold {len(runs)} image pad runs but the request has {len(urls)} images",
        )
    pixel_values, grid, per_image = process_images(processor, iter_images(urls, fetched, config))
    if per_image != runs:
        bad = next(i for i, (a, b) in enumerate(zip(per_image, runs, strict=True)) if a != b)
        raise RejectedEpisode(
            Reason.IMAGE_PAD_MISMATCH,
            f"image {bad}: processor needs {per_image[bad]} pad tokens, prompt ids hold {runs[bad]}",
        )
    stats["images"] = len(per_image)

    row = _assemble(seg, ids, version_of, reward, image_id, pixel_values, grid)
    stats["trained_tokens"] = int(row["loss_mask"].sum())
    return row


def _assemble(seg, ids, version_of, reward, image_id, pixel_values, grid) -> dict[str, Any]:
    """The row's tensors (the contract in ``cua_rl.core.row``), validated."""
    import torch

    n = len(ids)
    loss_mask = [0] * n
    logprobs = [0.0] * n
    versions = [-1] * n
    for start, end, turn in seg.spans:
        lp = turn.output_logprobs
        per_token = turn.output_versions
        if per_token is not None and len(per_token) != end - start:
            raise ValueError(f"turn {turn.index}: {len(per_token)} versions for {end - start} ids")
        v = version_of[id(turn)]
        for k in range(end - start):
            loss_mask[start + k] = 1
            logprobs[start + k] = lp[k]
            versions[start + k] = per_token[k] if per_token is not None else v
    input_ids = torch.tensor(ids, dtype=torch.long).unsqueeze(0)
    row = {
        "input_ids": input_ids,
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int32).unsqueeze(0),
        "logprobs": torch.tensor(logprobs, dtype=torch.float32).unsqueeze(0),
        "versions": torch.tensor(versions, dtype=torch.int32).unsqueeze(0),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
        "mm_token_type_ids": (input_ids == image_id).to(torch.long),
        "multi_modal_input": [{"pixel_values": pixel_values, "image_grid_thw": grid}],
    }
    validate_row(row)
    return row


def image_urls_needed(turns: Sequence[Turn], config: TrajectoryConfig | None = None) -> list[str]:
    """The image URLs conversion will read: the last prompt's (it carries the whole history),
    plus those of turns that the retokenising fallback will rebuild."""
    config = config or TrajectoryConfig()
    if not turns:
        return []
    urls = list(turns[-1].image_urls)
    if config.missing_tokens_policy == "retokenize":
        for t in turns:
            if t.missing:
                urls.extend(u for u in t.image_urls if u not in urls)
    return urls


def row_summary(result: ConversionResult) -> dict[str, Any]:
    """The one-line summary the CLI prints (and the workflow can log)."""
    s = result.stats
    return {
        "turns": s.get("turns", 0),
        "row_len": s.get("row_len", 0) if result.ok else 0,
        "trained_tokens": s.get("trained_tokens", 0) if result.ok else 0,
        "images": s.get("images", 0) if result.ok else 0,
        "prefix_breaks": s.get("prefix_breaks", 0),
        "trained_turns": s.get("trained_turns", 0) if result.ok else 0,
        "rejected": result.reason,
        "detail": result.detail or None,
    }
