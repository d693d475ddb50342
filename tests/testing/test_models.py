"""The tiny-model builders: deterministic, loadable, and shaped as the rest of the suite needs."""

from __future__ import annotations

import hashlib

import pytest

from cua_rl.testing.models import SPECIAL_TOKENS, build_tiny_qwen2, build_tiny_qwen2_vl


def _digests(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_vl_builder_is_deterministic(tmp_path, tokenizer):
    a = build_tiny_qwen2_vl(tmp_path / "a", tokenizer=tokenizer, seed=3)
    b = build_tiny_qwen2_vl(tmp_path / "b", tokenizer=tokenizer, seed=3)
    c = build_tiny_qwen2_vl(tmp_path / "c", tokenizer=tokenizer, seed=4)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_text_builder_is_deterministic(tmp_path):
    a = build_tiny_qwen2(tmp_path / "a", seed=1)
    b = build_tiny_qwen2(tmp_path / "b", seed=1)
    assert _digests(a) == _digests(b)


def test_byte_tokenizer_has_one_token_per_ascii_char(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vl_model_dir)
    text = 'tap(120,345) type("Hello, World!")'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(special) == i


def test_bpe_tokenizer_merges(tiny_vl_bpe_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vl_bpe_model_dir)
    text = "tap settings wifi bluetooth"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text)
    assert tok.decode(ids) == text


def test_vl_model_config_matches_vllm_constraints(tiny_vl_model_dir):
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(tiny_vl_model_dir)
    text = cfg.text_config
    assert text.hidden_size // text.num_attention_heads == 64
    proc = AutoProcessor.from_pretrained(tiny_vl_model_dir)
    assert len(proc.tokenizer) == text.vocab_size
    assert proc.tokenizer.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id


def test_vl_model_forward_runs_with_an_image(tiny_vl_model_dir):
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    proc = AutoProcessor.from_pretrained(tiny_vl_model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    batch = proc(
        text=[text], images=[Image.new("RGB", (360, 640), (9, 99, 199))], return_tensors="pt"
    )
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(out.logits).all()
