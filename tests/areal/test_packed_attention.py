"""Packed micro-batches (AReaL's FSDP layout) give each sequence its own logprobs under SDPA.

``cua_rl.areal.attention`` runs SDPA once per packed sequence: exact against each sequence's
unpacked forward (fp32, CPU), with no attention mask handed to torch (a dense mask would be
L x L per layer call on a GPU's 49k-token micro-batches).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cua_rl.areal.attention import keep_packed_sequences_apart, packed_sdpa, sequence_bounds

SEQS = [[5, 17, 33, 64, 101, 7, 9], [40, 41, 42, 43, 44], [3, 90, 12]]


@pytest.fixture(scope="module")
def model(tiny_text_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        tiny_text_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture
def restore_sdpa():
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    yield
    ALL_ATTENTION_FUNCTIONS["sdpa"] = original


class SdpaCalls:
    """Every call of torch's scaled_dot_product_attention: its query length and its mask."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, object]] = []
        original = torch.nn.functional.scaled_dot_product_attention

        def record(query, key, value, attn_mask=None, *args, **kwargs):
            self.calls.append((query.shape[-2], attn_mask))
            return original(query, key, value, attn_mask, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)


def _logprobs(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]


def _packed_forward(model, pad: int = 0) -> torch.Tensor:
    # The inputs AReaL's FSDP engine builds: one row, position ids restarting per sequence,
    # boundaries in cu_seq_lens_q/k, per-layer masks set to None, optional tail padding.
    ids = torch.tensor([t for s in SEQS for t in s] + [0] * pad)[None]
    pos = torch.cat([torch.arange(len(s)) for s in SEQS] + [torch.arange(pad)])[None]
    cu = torch.tensor(
        [0, *torch.cumsum(torch.tensor([len(s) for s in SEQS]), 0).tolist()], dtype=torch.int32
    )
    with torch.no_grad():
        return model(
            input_ids=ids,
            position_ids=pos,
            attention_mask={"full_attention": None, "sliding_attention": None},
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(map(len, SEQS)),
            max_length_k=max(map(len, SEQS)),
            use_cache=False,
        ).logits[0]


def _max_error(model, packed_logits) -> list[float]:
    errors, start = [], 0
    for seq in SEQS:
        ids = torch.tensor(seq)
        with torch.no_grad():
            alone = _logprobs(ids, model(ids[None]).logits[0])
        errors.append(
            (_logprobs(ids, packed_logits[start : start + len(seq)]) - alone).abs().max().item()
        )
        start += len(seq)
    return errors


def test_plain_sdpa_mixes_packed_sequences(model, restore_sdpa):
    # The failure the patch exists for; if transformers ever fixes it this test says so.
    # Transformers' own function: importing cua_rl.areal.actor installs ours process-wide.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    errors = _max_error(model, _packed_forward(model))
    assert errors[0] < 1e-5
    assert max(errors[1:]) > 1e-2


@pytest.mark.parametrize("pad", [0, 4])
def test_sdpa_per_sequence_equals_the_unpacked_forward_with_no_mask(
    model, restore_sdpa, monkeypatch, pad
):
    keep_packed_sequences_apart()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_sdpa
    calls = SdpaCalls(monkeypatch)
    packed = _packed_forward(model, pad=pad)
    in_packed = list(calls.calls)
    assert max(_max_error(model, packed)) < 1e-5
    layers = model.config.num_hidden_layers
    lengths = [len(s) for s in SEQS] + ([pad] if pad else [])
    # One call per sequence (the padding its own) in every layer, never a mask.
    assert [q for q, _ in in_packed] == lengths * layers
    assert all(mask is None for _, mask in in_packed)


def test_unpacked_calls_are_unchanged(model, restore_sdpa):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        before = model(ids).logits
        keep_packed_sequences_apart()
        after = model(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("cuts", "length", "bounds"),
    [
        ([0, 3, 5], 5, [(0, 3), (3, 5)]),
        ([0, 3, 5], 8, [(0, 3), (3, 5), (5, 8)]),  # tail padding: a block of its own
        ([0, 3, 3, 5], 5, [(0, 3), (3, 5)]),  # an empty sequence is left out
        ([0], 4, [(0, 4)]),
    ],
)
def test_sequence_bounds(cuts, length, bounds):
    assert sequence_bounds(torch.tensor(cuts, dtype=torch.int32), length) == bounds
