"""The training row's contract: what one accepted episode hands AReaL's PPO actor.

A row is one sequence (batch dimension 1) of ``n`` tokens: one segment's last prompt and output
ids as the model saw and sampled them (an episode gives one row per segment, a run of calls that
extend one another), with per-token loss mask, behaviour logprobs and policy versions, the
episode's reward and id, and the pixel values of the images its prompt holds (Qwen-VL's
processor output: ``pixel_values`` ``[patches, dim]`` and ``image_grid_thw`` ``[images, 3]``,
whose per-image ``t*h*w`` sum to ``patches``, and ``image_keys`` ``[images]``, each image's
content hash, by which the trainer encodes a screenshot several rows share once per
micro-batch). ``ROW_FIELDS`` spells out every key; the row
builder validates each row it returns with ``validate_row``, so a row that AReaL would misread
(a wrong dtype, a length that disagrees) fails where it is made, with the key named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cua_rl.errors import CuaRlError


@dataclass(frozen=True)
class RowField:
    key: str
    dtype: str  # torch dtype name
    shape: str  # in the row's own terms: n tokens, P patches, I images
    meaning: str


ROW_FIELDS: tuple[RowField, ...] = (
    RowField("input_ids", "int64", "[1, n]", "prompt + output ids of the trained segment"),
    RowField("loss_mask", "int32", "[1, n]", "1 on sampled tokens, 0 elsewhere"),
    RowField("logprobs", "float32", "[1, n]", "behaviour logprob of each sampled token, else 0"),
    RowField("versions", "int32", "[1, n]", "policy version that sampled the token, else -1"),
    RowField("attention_mask", "bool", "[1, n]", "all true (one unpadded sequence)"),
    RowField("rewards", "float32", "[1]", "the episode's reward"),
    RowField(
        "episode_id",
        "int64",
        "[1]",
        "the episode's id, the same on each of its rows: groups count episodes, not rows",
    ),
    RowField("mm_token_type_ids", "int64", "[1, n]", "1 on image pad tokens, 0 elsewhere"),
    RowField(
        "multi_modal_input",
        "list[dict]",
        "[1]",
        "one dict: pixel_values float32 [P, dim], image_grid_thw int64 [I, 3], image_keys int64 "
        "[I] (content hashes: equal keys, equal images)",
    ),
)
ROW_KEYS: tuple[str, ...] = tuple(f.key for f in ROW_FIELDS)
_PER_TOKEN = tuple(f.key for f in ROW_FIELDS if f.shape == "[1, n]")


class RowContractError(CuaRlError, ValueError):
    """A row does not have the keys, dtypes or shapes AReaL's actor expects."""


def validate_row(row: Mapping[str, Any]) -> None:
    """Raise ``RowContractError`` naming the first key that breaks the contract."""
    import torch

    keys = set(row)
    if keys != set(ROW_KEYS):
        raise RowContractError(
            f"row keys differ from the contract: missing {sorted(set(ROW_KEYS) - keys)}, "
            f"unexpected {sorted(keys - set(ROW_KEYS))}"
        )
    for f in ROW_FIELDS:
        value = row[f.key]
        if f.key == "multi_modal_input":
            continue
        if not isinstance(value, torch.Tensor) or str(value.dtype) != f"torch.{f.dtype}":
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise RowContractError(f"{f.key} must be a {f.dtype} tensor {f.shape}, not {got}")
    n = row["input_ids"].shape[-1]
    for key in _PER_TOKEN:
        if tuple(row[key].shape) != (1, n):
            raise RowContractError(f"{key} has shape {tuple(row[key].shape)}, not (1, {n})")
    for key in ("rewards", "episode_id"):
        if tuple(row[key].shape) != (1,):
            raise RowContractError(f"{key} has shape {tuple(row[key].shape)}, not (1,)")
    if not bool(((row["loss_mask"] == 0) | (row["loss_mask"] == 1)).all()):
        raise RowContractError("loss_mask holds values other than 0 and 1")
    _validate_images(row["multi_modal_input"])


def _validate_images(mm: Any) -> None:
    import torch

    if not isinstance(mm, list) or len(mm) != 1 or not isinstance(mm[0], Mapping):
        raise RowContractError("multi_modal_input must be a list of one dict")
    pixels, grid = mm[0].get("pixel_values"), mm[0].get("image_grid_thw")
    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.float32 or pixels.dim() != 2:
        raise RowContractError("multi_modal_input pixel_values must be a float32 [P, dim] tensor")
    if not isinstance(grid, torch.Tensor) or grid.dtype != torch.long or grid.dim() != 2:
        raise RowContractError("multi_modal_input image_grid_thw must be an int64 [I, 3] tensor")
    if grid.shape[1] != 3:
        raise RowContractError(f"image_grid_thw has shape {tuple(grid.shape)}, not (I, 3)")
    keys = mm[0].get("image_keys")
    if keys is not None and (
        not isinstance(keys, torch.Tensor)
        or keys.dtype != torch.long
        or tuple(keys.shape) != (grid.shape[0],)
    ):
        raise RowContractError(
            f"multi_modal_input image_keys must be an int64 [{grid.shape[0]}] tensor (one key "
            "per image)"
        )
    patches = int(grid.prod(-1).sum()) if grid.numel() else 0
    if patches != pixels.shape[0]:
        raise RowContractError(
            f"image_grid_thw describes {patches} patches and pixel_values holds {pixels.shape[0]}"
        )
