"""A stored episode as supervised examples: one per row it trained (docs/warehouse.md, *Export*).

The trainer trains rows, not episodes: an append-only agent's episode is one row (each call
extends the one before), an agent that rebuilds its context every call (MAI-UI's window, the
current screenshot only) gives a row per call. Each row becomes one example in TRL's
conversational layout: its last call's request as the model received it (images as
``{"type": "image"}`` placeholders, the row's own images exactly, in placeholder order), then as
the assistant turn the ids that call sampled, decoded by the model's tokenizer (never the
agent's re-rendered history). The example keeps the row's exact ids, loss mask, logprobs and
versions, so ``episode_from_examples`` and ``rebuild_rows`` give back the rows that trained.

Pure functions: the caller hands in the images' bytes and the ``decode`` of the model's tokenizer.
A row that cannot be an example whole is skipped and counted by reason (``ROW_SKIPS``).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cua_rl.warehouse.episode import StoredEpisode, StoredRow

# How a training whose agent built its own context (agent.context empty) is named.
OWN_CONTEXT = "the agent's own"
# Why a row or an episode is left out of an export; the card and the command print these.
EPISODE_SKIPS = {
    "image_missing": "an image of the episode is not in the monitor's screenshot store",
}
ROW_SKIPS = {
    "no_messages": "the agent logged no request for the row's last call",
    "image_placeholders": "the request names another number of images than the row holds",
}

# The columns, in order, with what each holds (the dataset card lists them from here).
FIELDS = {
    "messages": "TRL's conversational layout: the row's last request as the model received it "
    '(`{"role", "content": [{"type": "text", "text"} or {"type": "image"}]}`), then the '
    "assistant turn that call sampled, decoded from its recorded ids",
    "images": "the row's images, one per placeholder in order, as the bytes the model received",
    "training": "the training's run name",
    "context": "the agent's context policy in that training (full, mai-ui, current; empty: the "
    "agent's own)",
    "model": "the training's model name",
    "task_id": "the task",
    "rollout_uuid": "the episode's rollout",
    "episode_id": "the episode's id in its rows (the same on every example of the episode)",
    "training_step": "the training step whose batch the episode was sampled for",
    "row": "the row's index in its episode",
    "episode_rows": "rows (examples) of the episode",
    "turn": "index of the model call whose reply is the assistant turn",
    "agent_step": "the agent step of that call",
    "turns": "the calls the row trains: index, agent step, the agent's actions (JSON)",
    "reward": "the episode's reward",
    "success": "whether the episode succeeded",
    "version_min": "oldest policy version that sampled a token of the episode",
    "version_max": "newest policy version that sampled a token of the episode",
    "prompt_tokens": "where the assistant turn starts in input_ids: input_ids[:prompt_tokens] is "
    "the request as the model received it",
    "input_ids": "the trained row's token ids, exact",
    "loss_mask": "1 on every sampled token of the row",
    "logprobs": "the sampling engine's logprob of each sampled token (0 elsewhere)",
    "versions": "the policy version that sampled each token (-1 on prompt tokens)",
}


def features():
    """The dataset's columns (``datasets.Features``), in ``FIELDS`` order."""
    from datasets import Features, Image, List, Value

    part = {"type": Value("string"), "text": Value("string")}
    kinds = {
        "messages": List({"role": Value("string"), "content": List(part)}),
        "images": List(Image()),
        "turns": List(
            {"index": Value("int32"), "step": Value("int32"), "actions": Value("string")}
        ),
        "input_ids": List(Value("int64")),
        "loss_mask": List(Value("int8")),
        "logprobs": List(Value("float32")),
        "versions": List(Value("int32")),
        "reward": Value("float32"),
        "success": Value("bool"),
        "episode_id": Value("int64"),
    }
    for name in ("training_step", "row", "episode_rows", "turn", "agent_step", "prompt_tokens"):
        kinds[name] = Value("int32")
    for name in ("version_min", "version_max"):
        kinds[name] = Value("int32")
    return Features({name: kinds.get(name, Value("string")) for name in FIELDS})


def completion_start(row: StoredRow) -> int:
    """Where the row's last call's sampled tokens start: a row is its last call's prompt and
    output, so the output is the run of sampled tokens that ends the row (empty when that call
    sampled none)."""
    start = len(row.loss_mask)
    while start > 0 and row.loss_mask[start - 1]:
        start -= 1
    return start


def _messages(row: StoredRow, reply: str) -> list[dict]:
    out = [
        {
            "role": m["role"],
            "content": [{"type": p["type"], "text": p.get("text")} for p in m["content"]],
        }
        for m in row.messages or ()
    ]
    out.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return out


def row_skip(row: StoredRow) -> str | None:
    """Why ``row`` cannot be an example (a ``ROW_SKIPS`` key), or None."""
    if row.messages is None:
        return "no_messages"
    placeholders = sum(p.get("type") == "image" for m in row.messages for p in m["content"])
    if placeholders != len(row.images):
        return "image_placeholders"
    return None


def examples_of(
    ep: StoredEpisode,
    decode: Callable[[Sequence[int]], str],
    source: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], Counter]:
    """The examples of ``ep``'s rows (its images in hand) and the rows skipped, by reason.

    ``decode(ids)``: the sampled ids as text (the model's tokenizer); ``source``: the columns
    the episode's training gives (``training``, ``context``, ``model``, ``training_step``)."""
    turns = {t["index"]: t for t in ep.turns}
    out, skipped = [], Counter()
    for i, row in enumerate(ep.rows):
        reason = row_skip(row)
        if reason is not None:
            skipped[reason] += 1
            continue
        start = completion_start(row)
        last = turns.get(row.turns[-1], {}) if row.turns else {}
        out.append(
            {
                "messages": _messages(row, decode(row.input_ids[start:])),
                "images": [{"bytes": ep.images[h], "path": None} for h in row.images],
                **{k: source.get(k) for k in ("training", "context", "model", "training_step")},
                "task_id": ep.task_id,
                "rollout_uuid": ep.rollout_uuid,
                "episode_id": ep.episode_id,
                "row": i,
                "episode_rows": len(ep.rows),
                "turn": row.turns[-1] if row.turns else None,
                "agent_step": last.get("step"),
                "turns": [_turn(turns.get(t, {"index": t})) for t in row.turns],
                "reward": ep.reward,
                "success": ep.success,
                "version_min": ep.version_min,
                "version_max": ep.version_max,
                "prompt_tokens": start,
                "input_ids": row.input_ids,
                "loss_mask": row.loss_mask,
                "logprobs": row.logprobs,
                "versions": row.versions,
            }
        )
    return out, skipped


def _turn(t: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "index": t["index"],
        "step": t.get("step"),
        "actions": json.dumps(t.get("actions") or []),
    }


def episode_from_examples(records: Sequence[Mapping[str, Any]]) -> StoredEpisode:
    """One episode's examples (any order; images undecoded: ``Image(decode=False)``, their
    bytes) back as a ``StoredEpisode`` of those rows, for ``rebuild_rows``."""
    if not records or len({r["rollout_uuid"] for r in records}) != 1:
        raise ValueError("episode_from_examples takes the examples of one episode")
    records = sorted(records, key=lambda r: r["row"])
    images: dict[str, bytes] = {}
    rows = []
    for r in records:
        hashes = []
        for img in r["images"]:
            digest = hashlib.sha256(img["bytes"]).hexdigest()
            images[digest] = img["bytes"]
            hashes.append(digest)
        rows.append(
            StoredRow(
                input_ids=list(r["input_ids"]),
                loss_mask=list(r["loss_mask"]),
                logprobs=list(r["logprobs"]),
                versions=list(r["versions"]),
                images=tuple(hashes),
                turns=tuple(t["index"] for t in r["turns"]),
            )
        )
    first = records[0]
    return StoredEpisode(
        task_id=first["task_id"],
        episode_id=first["episode_id"],
        rollout_uuid=first["rollout_uuid"],
        training=first["training"],
        reward=first["reward"],
        success=first["success"],
        version_min=first["version_min"],
        version_max=first["version_max"],
        rows=rows,
        images=images,
    )
