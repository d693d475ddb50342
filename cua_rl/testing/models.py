"""Deterministic builders for tiny random models, with no download.

Three kinds, each a complete Hugging Face model folder (config, weights, tokenizer, chat template,
and for the VLMs the processor) that both transformers and vLLM load:

- ``build_tiny_qwen2_vl(dst, tokenizer="bpe")``: Qwen2-VL (vision + text) with a byte-level BPE
  tokenizer that has merges. Under sampling the multi-turn prefix property breaks with it
  (docs/design.md, vLLM), which is what the prefix-break tests need.
- ``build_tiny_qwen2_vl(dst, tokenizer="byte")``: the same with a byte-only tokenizer (no merges):
  every printable ASCII character is one token, so ASCII-constrained sampling keeps the prefix
  property across turns.
- ``build_tiny_qwen2(dst)``: a text-only Qwen2 with the BPE tokenizer.
- ``build_tiny_qwen2_vl(dst, tokenizer="byte", vocab_size=WIDE_VOCAB)`` ("qwen2-vl-wide"): the
  byte-tokenizer Qwen2-VL with a production-sized output layer (Qwen-VL's 151,936 ids; the ids
  past the tokenizer are never produced by it). Its full-vocabulary logits dominate a training
  step's memory as they do for a real Qwen-VL model, which is what memory tests and
  ``bench/row_memory.py`` need; the rest of the model stays tiny.

Same arguments, same bytes: the tokenizer corpus is generated, the weights come from a seeded
generator, and file writes are sorted. ``ensure_model`` builds into a cache folder once, atomically,
so concurrent test sessions share one copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cua_rl.testing.templates import TEMPLATES

# Qwen's special tokens, first in the vocabulary so their ids are small and stable.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TOKEN_ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
# The vision-language configs' special token ids.
VISION_TOKEN_IDS = {
    "image_token_id": TOKEN_ID["<|image_pad|>"],
    "video_token_id": TOKEN_ID["<|video_pad|>"],
    "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
    "vision_end_token_id": TOKEN_ID["<|vision_end|>"],
}

# Output-layer width of the Qwen2-VL and Qwen2.5-VL checkpoints (config.vocab_size).
WIDE_VOCAB = 151_936

# Patch 14, merge 2: one image token per 28x28 pixels. The pixel budget keeps a phone screenshot
# (360x640) at a few dozen image tokens, so 30-turn episodes stay cheap on a CPU.
IMAGE_FACTOR = 28
MIN_PIXELS = IMAGE_FACTOR * IMAGE_FACTOR * 4
MAX_PIXELS = IMAGE_FACTOR * IMAGE_FACTOR * 32

CHAT_TEMPLATE = TEMPLATES["qwen2-vl"]


def _tokenizer_corpus() -> list[str]:
    """A small generated corpus in the agent's register: chat words, actions, coordinates."""
    words = (
        "tap swipe type key back home wait finished open settings wifi bluetooth brightness notes "
        "contacts calculator screen button toggle slider text the a to and on off of in you are "
        "helpful assistant task step action answer screenshot phone app turn enable disable"
    ).split()
    lines = []
    for i in range(400):
        a, b, c = words[i % len(words)], words[(i * 7) % len(words)], words[(i * 13) % len(words)]
        lines.append(f'{a} {b} {c} tap({(i * 37) % 360},{(i * 91) % 640}) type("{b} {c}")')
    return lines


def _build_tokenizer(kind: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind == "byte":
        # Specials first, then the 256 byte symbols in a fixed order; no merges at all.
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for sym in sorted(alphabet):
            vocab[sym] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = byte_level
        trainer = trainers.BpeTrainer(
            vocab_size=len(SPECIAL_TOKENS) + 256 + 400,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=alphabet,
            show_progress=False,
        )
        tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; use 'byte' or 'bpe'")
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for t in SPECIAL_TOKENS:
        assert tok.token_to_id(t) == TOKEN_ID[t], f"special token {t} moved"
    return tok


def _wrap_tokenizer(tok, chat_template: str = CHAT_TEMPLATE):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=32768,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def _seeded_init(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def _text_config(vocab_size: int, *, tied: bool = False) -> dict:
    # head_dim 64 (hidden 128 / 2 heads): vLLM's CPU attention rejects head_dim 16.
    return dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=TOKEN_ID["<|endoftext|>"],
        eos_token_id=TOKEN_ID["<|im_end|>"],
        pad_token_id=TOKEN_ID["<|endoftext|>"],
        tie_word_embeddings=tied,
    )


def _save_generation_config(dst: Path) -> None:
    (dst / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": TOKEN_ID["<|endoftext|>"],
                "eos_token_id": [TOKEN_ID["<|im_end|>"], TOKEN_ID["<|endoftext|>"]],
                "pad_token_id": TOKEN_ID["<|endoftext|>"],
            },
            indent=2,
            sort_keys=True,
        )
    )


def build_tiny_qwen2_vl(
    dst: str | os.PathLike,
    *,
    tokenizer: str = "bpe",
    seed: int = 0,
    vocab_size: int | None = None,
    tied: bool = False,
) -> Path:
    """Write a tiny random Qwen2-VL (vision + text, text head_dim 64) into ``dst``.

    ``vocab_size`` widens the embedding and output layers past the tokenizer (default: exactly
    the tokenizer's size, so every id detokenizes). ``tied``: the output layer shares the input
    embedding (AReaL then makes no embedding an FSDP unit of its own).
    """
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tok = _wrap_tokenizer(_build_tokenizer(tokenizer))
    if vocab_size is not None and vocab_size < len(tok):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tok)} ids)")
    text = _text_config(vocab_size or len(tok), tied=tied)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        # Sums to head_dim / 2 = 32 (temporal, height, width sections of M-RoPE).
        "mrope_section": [8, 12, 12],
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            embed_dim=128,
            hidden_size=text["hidden_size"],
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **VISION_TOKEN_IDS,
        tie_word_embeddings=tied,
        **{k: text[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")},
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    _seeded_init(model, seed)
    model.save_pretrained(dst, safe_serialization=True)
    _save_generation_config(dst)

    kwargs = processor_kwargs(14, MIN_PIXELS, MAX_PIXELS)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kwargs),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**kwargs),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


def processor_kwargs(patch: int, min_pixels: int, max_pixels: int, **extra) -> dict:
    """The image and video processors' settings: patch size, merge 2, two frames per patch and
    the pixel budget (both spellings: ``min/max_pixels`` and ``size``)."""
    return dict(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        **extra,
    )


def build_tiny_qwen2(dst: str | os.PathLike, *, tokenizer: str = "bpe", seed: int = 0) -> Path:
    """Write a tiny random text-only Qwen2 (head_dim 64) into ``dst``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tok = _wrap_tokenizer(_build_tokenizer(tokenizer))
    text = _text_config(len(tok))
    config = Qwen2Config(**text, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    _seeded_init(model, seed)
    model.save_pretrained(dst, safe_serialization=True)
    _save_generation_config(dst)
    tok.save_pretrained(dst)
    return dst
