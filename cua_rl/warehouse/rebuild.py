"""Rows <-> stored episodes, both ways, as pure functions.

``stored_from_rows`` keeps what the converter built (its rows' token tensors and each row's image
hashes); ``rebuild_rows`` makes the rows again with the model's processor. Rebuilt rows equal the
trained ones token for token and pixel for pixel because the converter processes each distinct
image alone (``cua_rl.trajectory.rows.ImageCache``) with the deterministic processor, from the
same bytes, and this does the same. The rows are the converter's: the episode's own reward, not
the group-normalised one the group filter writes later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cua_rl.core.images import decode_image, image_token_ids, process_images
from cua_rl.core.row import validate_row
from cua_rl.errors import CuaRlError
from cua_rl.trajectory.events import Turn
from cua_rl.trajectory.rows import ConversionResult, image_key_of, pad_runs
from cua_rl.warehouse.episode import StoredEpisode, StoredRow


class RebuildError(CuaRlError, ValueError):
    """A stored episode cannot give rows: an image is missing, or its pads disagree."""


def stored_from_rows(
    rows: Sequence[Mapping[str, Any]],
    row_images: Sequence[Sequence[str]],
    *,
    task_id: str,
    rollout_uuid: str,
    training: str,
    success: bool,
    images: Mapping[str, bytes],
    row_turns: Sequence[Sequence[int]] = (),
    row_messages: Sequence[list[dict] | None] = (),
    turns: Sequence[dict] = (),
    row_spans: Sequence[Sequence[tuple[int, int, int]]] = (),
) -> StoredEpisode:
    """The stored form of an episode's rows (``ConversionResult.rows``) and their images."""
    if len(rows) != len(row_images):
        raise ValueError(f"{len(row_images)} image lists for {len(rows)} rows")
    stored_rows = []
    for i, row in enumerate(rows):
        stored_rows.append(
            StoredRow(
                input_ids=row["input_ids"][0].tolist(),
                loss_mask=row["loss_mask"][0].tolist(),
                logprobs=row["logprobs"][0].tolist(),
                versions=row["versions"][0].tolist(),
                images=tuple(row_images[i]),
                turns=tuple(row_turns[i]) if row_turns else (),
                messages=row_messages[i] if row_messages else None,
                spans=tuple(tuple(span) for span in row_spans[i]) if row_spans else (),
            )
        )
    sampled = [v for r in stored_rows for v, m in zip(r.versions, r.loss_mask, strict=True) if m]
    wanted = {h for r in stored_rows for h in r.images}
    return StoredEpisode(
        task_id=task_id,
        episode_id=int(rows[0]["episode_id"][0]),
        rollout_uuid=rollout_uuid,
        training=training,
        reward=float(rows[0]["rewards"][0]),
        success=bool(success),
        version_min=min(sampled, default=-1),
        version_max=max(sampled, default=-1),
        rows=stored_rows,
        turns=list(turns),
        images={h: images[h] for h in wanted},
    )


def rebuild_rows(stored_episode: StoredEpisode, processor) -> list[dict[str, Any]]:
    """The training rows of ``stored_episode``, as the converter built them (validated).

    Needs ``stored_episode.images`` to hold every image its rows name (``RebuildError`` names
    the first missing one). Each distinct image is processed once.
    """
    import torch

    ep = stored_episode
    missing = [h for h in ep.image_hashes if h not in ep.images]
    if missing:
        raise RebuildError(
            f"episode {ep.rollout_uuid}: image {missing[0]} not in hand ({len(missing)} missing)"
        )
    image_id, _ = image_token_ids(processor)
    processed: dict[str, tuple] = {}
    for h in ep.image_hashes:
        pixels, grid, pads = process_images(processor, [decode_image(f"sha256:{h}", ep.images[h])])
        processed[h] = (pixels, grid, pads[0])
    out = []
    for i, r in enumerate(ep.rows):
        runs = pad_runs(r.input_ids, image_id)
        if len(runs) != len(r.images) or any(
            processed[h][2] != n for h, n in zip(r.images, runs, strict=False)
        ):
            raise RebuildError(
                f"episode {ep.rollout_uuid}, row {i}: prompt pad runs {runs} do not match the "
                f"processor's pads for its {len(r.images)} images (another processor?)"
            )
        if r.images:
            pixel_values = torch.cat([processed[h][0] for h in r.images])
            grid = torch.cat([processed[h][1] for h in r.images])
        else:
            pixel_values, grid, _ = process_images(processor, [])
        input_ids = torch.tensor(r.input_ids, dtype=torch.long).unsqueeze(0)
        row = {
            "input_ids": input_ids,
            "loss_mask": torch.tensor(r.loss_mask, dtype=torch.int32).unsqueeze(0),
            "logprobs": torch.tensor(r.logprobs, dtype=torch.float32).unsqueeze(0),
            "versions": torch.tensor(r.versions, dtype=torch.int32).unsqueeze(0),
            "attention_mask": torch.ones((1, len(r)), dtype=torch.bool),
            "rewards": torch.tensor([ep.reward], dtype=torch.float32),
            "episode_id": torch.tensor([ep.episode_id], dtype=torch.long),
            "mm_token_type_ids": (input_ids == image_id).to(torch.long),
            "multi_modal_input": [
                {
                    "pixel_values": pixel_values,
                    "image_grid_thw": grid,
                    "image_keys": torch.tensor(
                        [image_key_of(h) for h in r.images], dtype=torch.long
                    ),
                }
            ],
        }
        validate_row(row)
        out.append(row)
    return out


def stored_episode_of(
    result: ConversionResult,
    event_turns: Sequence[Turn],
    *,
    task_id: str,
    rollout_uuid: str,
    training: str,
    success: bool,
) -> StoredEpisode:
    """The stored form of an accepted episode: the converter's ``result`` (its rows, their image
    hashes and bytes) and the agent's turns (each row's last request, the replies and actions;
    matched by position, as the converter's turns are numbered)."""
    by_index = {t.index: t for t in event_turns}
    messages = []
    for turns in result.row_turns:
        last = by_index.get(turns[-1]) if turns else None
        messages.append(model_messages(last.messages) if last and last.messages else None)
    trained = sorted({i for turns in result.row_turns for i in turns})
    return stored_from_rows(
        result.rows,
        result.row_images,
        task_id=task_id,
        rollout_uuid=rollout_uuid,
        training=training,
        success=success,
        images=result.image_data,
        row_turns=result.row_turns,
        row_messages=messages,
        row_spans=result.row_spans,
        turns=[
            {
                "index": i,
                "step": by_index[i].step,
                "text": by_index[i].text,
                "actions": by_index[i].actions,
            }
            for i in trained
            if i in by_index
        ],
    )


def model_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """A request's messages with every image part as ``{"type": "image"}`` (in order; the
    images are the row's), text parts as ``{"type": "text", "text": ...}``: TRL's layout."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) or content is None:
            parts = [{"type": "text", "text": content or ""}]
        else:
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind in ("image_url", "image", "input_image"):
                    parts.append({"type": "image"})
                elif kind in ("text", "input_text"):
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
        out.append({"role": str(m.get("role", "user")), "content": parts})
    return out
