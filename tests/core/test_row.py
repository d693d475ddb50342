"""The training row's contract: a row built by hand to it passes, each breach names its key."""

from __future__ import annotations

import pytest
import torch

from cua_rl.core.row import ROW_FIELDS, ROW_KEYS, RowContractError, validate_row


def _row(n: int = 5, **overrides):
    """A row of ``n`` tokens with one 2x2-patch image, as the contract describes it."""
    row = {
        "input_ids": torch.arange(n, dtype=torch.long).unsqueeze(0),
        "loss_mask": torch.tensor([[0] * (n - 2) + [1, 1]], dtype=torch.int32),
        "logprobs": torch.zeros((1, n), dtype=torch.float32),
        "versions": torch.full((1, n), -1, dtype=torch.int32),
        "attention_mask": torch.ones((1, n), dtype=torch.bool),
        "rewards": torch.tensor([1.0]),
        "episode_id": torch.tensor([7]),
        "mm_token_type_ids": torch.zeros((1, n), dtype=torch.long),
        "multi_modal_input": [
            {
                "pixel_values": torch.zeros((4, 1176), dtype=torch.float32),
                "image_grid_thw": torch.tensor([[1, 2, 2]], dtype=torch.long),
            }
        ],
    }
    row.update(overrides)
    return row


def test_a_row_to_the_contract_passes():
    assert ROW_KEYS == tuple(f.key for f in ROW_FIELDS)
    validate_row(_row())
    no_images = {
        "pixel_values": torch.zeros((0, 1176)),
        "image_grid_thw": torch.zeros((0, 3), dtype=torch.long),
    }
    validate_row(_row(multi_modal_input=[no_images]))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"loss_mask": torch.ones((1, 5), dtype=torch.int64)}, "loss_mask must be a int32"),
        ({"logprobs": [0.0] * 5}, "logprobs must be a float32 tensor"),
        ({"versions": torch.zeros((1, 4), dtype=torch.int32)}, r"versions has shape \(1, 4\)"),
        ({"rewards": torch.tensor([[1.0]])}, "rewards has shape"),
        ({"episode_id": torch.tensor([7, 7])}, "episode_id has shape"),
        ({"episode_id": torch.tensor([7.0])}, "episode_id must be a int64"),
        ({"loss_mask": torch.full((1, 5), 2, dtype=torch.int32)}, "other than 0 and 1"),
        ({"multi_modal_input": {}}, "a list of one dict"),
        (
            {
                "multi_modal_input": [
                    {
                        "pixel_values": torch.zeros((3, 1176)),
                        "image_grid_thw": torch.tensor([[1, 2, 2]]),
                    }
                ]
            },
            "describes 4 patches and pixel_values holds 3",
        ),
    ],
)
def test_each_breach_is_named(overrides, words):
    with pytest.raises(RowContractError, match=words):
        validate_row(_row(**overrides))


def test_a_missing_or_extra_key_is_named():
    row = _row()
    del row["versions"]
    row["extra"] = 1
    with pytest.raises(RowContractError, match=r"missing \['versions'\], unexpected \['extra'\]"):
        validate_row(row)
