"""Turns -> an episode's training rows: one per run of calls that extend one another.

Rows are built from the ids the model saw and sampled (docs/design.md, decisions 1 and 2). Turn t
joins the running segment when its prompt ids start with the segment so far (turn t-1's prompt +
output); the segment's ids then become turn t's prompt + output, and every earlier turn's output
keeps its position, so its loss mask, logprobs and version can be laid on the final ids. When the
property breaks (an agent that keeps a window of screenshots or re-renders its history breaks it
on every call) a new segment starts, and each segment becomes a row of its own: every answered
call is trained exactly once and no row mixes contexts. An append-only agent gives one row.

A row's images are those of its last prompt; their pad-token runs in the prompt ids must match
what the processor computes per image, or the episode is rejected. Each distinct image (by its
bytes) goes through the processor once per episode however many rows hold it, and is let go
after the last row that holds it, so a sliding window's conversion holds about a window of
processed images, whatever the episode's length. Every row carries the episode's reward and id:
the group filter counts episodes by that id, not rows (``cua_rl.rollout.groups``).

``convert_turns`` is pure (no network): http(s) images arrive as bytes from
:func:`cua_rl.core.images.fetch_images`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cua_rl.core.images import (
    decode_image,
    image_bytes,
    image_token_ids,
    load_images,
    process_images,
    tokenizer_of,
)
from cua_rl.core.reasons import Reason
from cua_rl.core.row import validate_row
from cua_rl.errors import RejectedEpisode
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.trajectory.events import Turn


@dataclass
class Segment:
    """Consecutive turns whose prompts extend each other; ``ids`` is the last prompt + output."""

    turns: list[Turn]
    ids: list[int]
    # (start, end, turn) spans of generated tokens within ``ids``
    spans: list[tuple[int, int, Turn]] = field(default_factory=list)


@dataclass
class ConversionResult:
    """An episode's rows, or the reason there are none; ``stats`` is filled in both cases as far
    as known. ``trained`` holds the indices of the turns the rows train, ``trained_steps`` the
    agent steps they belong to (the monitor's turns)."""

    rows: list[dict[str, Any]] | None
    reason: str | None = None
    detail: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    trained: frozenset[int] = frozenset()
    trained_steps: frozenset[int] = frozenset()
    # Per row: the sha256 of each image of its prompt (in order) and the turn indices it trains;
    # the images' bytes by hash. What the trajectory warehouse stores (cua_rl.warehouse).
    row_images: list[tuple[str, ...]] = field(default_factory=list)
    row_turns: list[tuple[int, ...]] = field(default_factory=list)
    image_data: dict[str, bytes] = field(default_factory=dict, repr=False)
    # Per row, each trained turn's sampled tokens: (start, end, turn index) in the row's
    # positions. Two turns' tokens can touch (a re-ask's prompt is the call before it with its
    # reply), so a row's runs of loss mask alone do not tell its turns apart (step credit).
    row_spans: list[tuple[tuple[int, int, int], ...]] = field(default_factory=list)
    _batch: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.rows is not None

    @property
    def row(self) -> dict[str, Any] | None:
        """The episode's rows as one batch (``[rows, n]``, padded), what the workflow hands
        AReaL; built once, so a change made to it is what is trained."""
        if self.rows is None:
            return None
        if self._batch is None:
            self._batch = self.rows[0] if len(self.rows) == 1 else stack_rows(self.rows)
        return self._batch

    def raise_if_rejected(self) -> dict[str, Any]:
        if self.rows is None:
            raise RejectedEpisode(self.reason or Reason.REJECTED, self.detail)
        return self.row


def stack_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rows -> one batch, padded as AReaL pads the rows of a group (its own function)."""
    from areal.utils.data import concat_padded_tensors

    return concat_padded_tensors(list(rows))


def unstack_rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A batch of rows -> the rows (each cut to its attention mask): for replay (which swaps an
    episode's rows in a group), tests and benches."""
    out = []
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        row = {}
        for key, value in batch.items():
            if key == "multi_modal_input":
                row[key] = [value[i]]
            elif value.dim() == 2:
                row[key] = value[i : i + 1, :n]
            else:
                row[key] = value[i : i + 1]
        out.append(row)
    return out


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


def episode_id_of(rollout_uuid: str) -> int:
    """A positive int64 id for an episode, from its rollout uuid (the row's ``episode_id``)."""
    return int(hashlib.sha256(rollout_uuid.encode()).hexdigest()[:15], 16)


def image_key_of(digest: str) -> int:
    """A positive int64 key for an image, from its sha256 hex digest (the row's
    ``image_keys``): the trainer encodes the images of a micro-batch that share a key once."""
    return int(digest[:15], 16)


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


class ImageCache:
    """Each distinct image of an episode through the processor once, kept until its last use.

    ``uses`` counts, per URL, the rows still to come that hold it; identical bytes under two
    URLs (a re-signed URL) share one entry.
    """

    def __init__(self, processor, fetched: Mapping[str, bytes], config: TrajectoryConfig, uses):
        self.processor, self.fetched, self.config = processor, fetched, config
        self.uses: Counter[str] = Counter(uses)
        self._by_url: dict[str, str] = {}  # url -> content hash
        self._held: dict[str, tuple[Any, Any, int]] = {}  # hash -> (pixels, grid [1,3], pads)
        self.data: dict[str, bytes] = {}  # hash -> the bytes the model received
        self._refs: Counter[str] = Counter()  # hash -> uses still to come
        self.processed = 0
        self.peak_bytes = 0

    def take(self, url: str) -> tuple[Any, Any, int, int]:
        """(pixel_values, image_grid_thw row, pad count, content key) of ``url``, for one row."""
        key = self._by_url.get(url)
        if key is None:
            raw = image_bytes(url, self.fetched, self.config)
            key = self._by_url[url] = hashlib.sha256(raw).hexdigest()
            self.data[key] = raw
            self._refs[key] += self.uses[url]
            if key not in self._held:
                pixels, grid, pads = process_images(self.processor, [decode_image(url, raw)])
                self._held[key] = (pixels, grid, pads[0])
                self.processed += 1
                held = sum(p.numel() * p.element_size() for p, _, _ in self._held.values())
                self.peak_bytes = max(self.peak_bytes, held)
        entry = self._held[key]
        self._refs[key] -= 1
        if self._refs[key] <= 0:
            del self._held[key]
        return (*entry, image_key_of(key))

    def digest(self, url: str) -> str:
        """The sha256 hex of ``url``'s bytes (after ``take``)."""
        return self._by_url[url]


def convert_turns(
    turns: Sequence[Turn],
    *,
    processor,
    reward: float,
    version: int | Sequence[int],
    config: TrajectoryConfig | None = None,
    fetched_images: Mapping[str, bytes] | None = None,
    episode_id: int = 0,
) -> ConversionResult:
    """Build the training rows of one episode; never raises for bad episode data.

    ``version`` is the engine's policy version for generated tokens: one int, or one per turn;
    a turn's own ``output_versions`` (one per token) take precedence.
    ``fetched_images`` maps the http(s) image URLs to their bytes (see ``fetch_images``).
    ``episode_id`` is written on every row (``episode_id_of(rollout_uuid)`` in the workflow).
    """
    config = config or TrajectoryConfig()
    stats: dict[str, Any] = {
        "turns": len(turns),
        "prefix_breaks": 0,
        "segments": 0,
        "rows": 0,
        "trained_turns": 0,
        "dropped_turns": 0,
        "row_len": 0,
        "row_tokens": 0,
        "sampled_tokens": 0,
        "trained_tokens": 0,
        "images": 0,
        "distinct_images": 0,
        "processed_images": 0,
        "retokenized_turns": 0,
    }
    trained: set[int] = set()
    store: dict[str, Any] = {}
    try:
        rows = _convert(
            turns, processor, reward, version, config, fetched_images or {}, stats, trained, store
        )
        for row in rows:
            row["episode_id"] = _episode_tensor(episode_id)
            validate_row(row)
    except RejectedEpisode as exc:
        return ConversionResult(None, exc.reason, exc.detail, stats)
    steps = frozenset(t.step for t in turns if t.index in trained)
    return ConversionResult(
        rows,
        None,
        "",
        stats,
        frozenset(trained),
        steps,
        store["images"],
        store["turns"],
        store["data"],
        store["spans"],
    )


def _episode_tensor(episode_id: int):
    import torch

    return torch.tensor([int(episode_id)], dtype=torch.long)


def _prepare(turns, processor, version, config, fetched, stats) -> tuple[list[Turn], dict]:
    """The turns with token data (the retokenising fallback applied), and each one's version."""
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
    return turns, {id(t): v for t, v in zip(turns, versions_per_turn, strict=True)}


def _kept_segments(segments: list[Segment], breaks: int, config, stats) -> list[Segment]:
    """The segments that become rows, by ``prefix_break_policy``."""
    if breaks and config.prefix_break_policy == "reject":
        n = sum(len(s.turns) for s in segments)
        raise RejectedEpisode(Reason.PREFIX_BREAK, f"{breaks} prefix break(s) in {n} turns")
    if config.prefix_break_policy == "last_segment":
        # The former behaviour, kept to measure what training every call is worth: the turns
        # before the last break are dropped, and counted.
        stats["dropped_turns"] = sum(len(s.turns) for s in segments[:-1])
        return segments[-1:]
    return segments


def _convert(turns, processor, reward, version, config, fetched, stats, trained, store) -> list:
    turns, version_of = _prepare(turns, processor, version, config, fetched, stats)
    stats["sampled_tokens"] = sum(len(t.output_ids) for t in turns)
    segments, breaks = split_segments(turns)
    stats["prefix_breaks"] = breaks
    stats["segments"] = len(segments)
    kept = _kept_segments(segments, breaks, config, stats)
    image_id, video_id = image_token_ids(processor)
    for seg in kept:
        _check_segment(seg, config, image_id, video_id)
    cache = ImageCache(
        processor, fetched, config, (u for seg in kept for u in seg.turns[-1].image_urls)
    )
    stats["distinct_images"] = len({u for seg in kept for u in seg.turns[-1].image_urls})
    rows = []
    for seg in kept:
        rows.append(_segment_row(seg, cache, version_of, reward, image_id))
        store.setdefault("images", []).append(
            tuple(cache.digest(u) for u in seg.turns[-1].image_urls)
        )
        store.setdefault("turns", []).append(tuple(t.index for t in seg.turns))
        store.setdefault("spans", []).append(tuple((a, b, t.index) for a, b, t in seg.spans))
        trained.update(t.index for t in seg.turns)
        stats["images"] += len(seg.turns[-1].image_urls)
        stats["row_tokens"] += len(seg.ids)
        stats["row_len"] = max(stats["row_len"], len(seg.ids))
    stats["rows"] = len(rows)
    stats["trained_turns"] = sum(len(seg.turns) for seg in kept)
    stats["trained_tokens"] = int(sum(int(r["loss_mask"].sum()) for r in rows))
    store["data"] = cache.data
    stats["processed_images"] = cache.processed
    stats["image_cache_peak_bytes"] = cache.peak_bytes
    return rows


def _check_segment(seg: Segment, config, image_id: int, video_id: int | None) -> None:
    """What makes a segment untrainable, checked before any image is processed."""
    ids, last = seg.ids, seg.turns[-1]
    if config.max_row_tokens and len(ids) > config.max_row_tokens:
        raise RejectedEpisode(Reason.ROW_TOO_LONG, f"{len(ids)} tokens > {config.max_row_tokens}")
    for start, end, _ in seg.spans:
        sampled = ids[start:end]
        if image_id in sampled or (video_id is not None and video_id in sampled):
            raise RejectedEpisode(
                Reason.IMAGE_TOKEN_IN_OUTPUT, "the model sampled an image/video pad token"
            )
    prompt = ids[: len(last.prompt_ids)]
    if video_id is not None and video_id in prompt:
        raise RejectedEpisode(Reason.VIDEO_UNSUPPORTED, "the prompt holds video tokens")
    urls = last.image_urls
    if len(urls) > config.max_images:
        raise RejectedEpisode(
            Reason.TOO_MANY_IMAGES, f"{len(urls)} images > max_images {config.max_images}"
        )
    runs = pad_runs(prompt, image_id)
    if len(runs) != len(urls):
        raise RejectedEpisode(
            Reason.IMAGE_COUNT_MISMATCH,
            f"turn {last.index}: prompt ids hold {len(runs)} image pad runs but the request has "
            f"{len(urls)} images",
        )


def _segment_row(seg: Segment, cache: ImageCache, version_of, reward, image_id) -> dict:
    """One segment's row: its images from the cache, their pad counts checked."""
    import torch

    last = seg.turns[-1]
    runs = pad_runs(seg.ids[: len(last.prompt_ids)], image_id)
    pixels, grids, keys = [], [], []
    for i, url in enumerate(last.image_urls):
        pv, grid, pads, key = cache.take(url)
        if pads != runs[i]:
            raise RejectedEpisode(
                Reason.IMAGE_PAD_MISMATCH,
                f"turn {last.index}, image {i}: processor needs {pads} pad tokens, prompt ids "
                f"hold {runs[i]}",
            )
        pixels.append(pv)
        grids.append(grid)
        keys.append(key)
    if pixels:
        pixel_values, grid = torch.cat(pixels), torch.cat(grids)
    else:
        pixel_values, grid, _ = process_images(cache.processor, [])
    image_keys = torch.tensor(keys, dtype=torch.long)
    return _assemble(seg, version_of, reward, image_id, pixel_values, grid, image_keys)


def _assemble(seg, version_of, reward, image_id, pixel_values, grid, keys) -> dict[str, Any]:
    """The row's tensors (the contract in ``cua_rl.core.row``; the caller adds the id)."""
    import torch

    ids = seg.ids
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
    return {
        "input_ids": input_ids,
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int32).unsqueeze(0),
        "logprobs": torch.tensor(logprobs, dtype=torch.float32).unsqueeze(0),
        "versions": torch.tensor(versions, dtype=torch.int32).unsqueeze(0),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
        "mm_token_type_ids": (input_ids == image_id).to(torch.long),
        "multi_modal_input": [
            {"pixel_values": pixel_values, "image_grid_thw": grid, "image_keys": keys}
        ],
    }


def image_urls_needed(turns: Sequence[Turn], config: TrajectoryConfig | None = None) -> list[str]:
    """The image URLs conversion will read, each once: every turn's (a row holds the images of
    its segment's last prompt, and segments are known only once the retokenising fallback has
    run; an append-only history names no image its last turn does not). ``config`` is kept for
    callers that pass it."""
    urls: list[str] = []
    for t in turns:
        urls.extend(u for u in t.image_urls if u not in urls)
    return urls


def row_summary(result: ConversionResult) -> dict[str, Any]:
    """The one-line summary the CLI prints (and the workflow can log)."""
    s = result.stats
    ok = result.ok
    return {
        "turns": s.get("turns", 0),
        "rows": s.get("rows", 0) if ok else 0,
        "row_len": s.get("row_len", 0) if ok else 0,
        "sampled_tokens": s.get("sampled_tokens", 0),
        "trained_tokens": s.get("trained_tokens", 0) if ok else 0,
        "images": s.get("images", 0) if ok else 0,
        "prefix_breaks": s.get("prefix_breaks", 0),
        "trained_turns": s.get("trained_turns", 0) if ok else 0,
        "rejected": result.reason,
        "detail": result.detail or None,
    }
