"""Packed micro-batches (AReaL's FSDP layout) give each sequence its own logprobs under SDPA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cua_rl.cpu.training import packed_sdpa_attention, patch_packed_attention

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
    errors = _max_error(model, _packed_forward(model))
    assert errors[0] < 1e-5
    assert max(errors[1:]) > 1e-2


@pytest.mark.parametrize("pad", [0, 4])
def test_patched_sdpa_keeps_sequences_apart(model, restore_sdpa, pad):
    patch_packed_attention()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_sdpa_attention
    assert max(_max_error(model, _packed_forward(model, pad=pad))) < 1e-5


def test_unpacked_calls_are_unchanged(model, restore_sdpa):
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        before = model(ids).logits
        patch_packed_attention()
        after = model(ids).logits
    assert torch.equal(before, after)
