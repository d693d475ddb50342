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


def test_wide_vl_model_has_the_production_vocabulary():
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from cua_rl.testing.cache import ensure_model

    path = ensure_model("qwen2-vl-wide")
    cfg = AutoConfig.from_pretrained(path)
    # Qwen2-VL's released checkpoints have 151,936 output ids.
    assert cfg.text_config.vocab_size == 151_936
    model = AutoModelForImageTextToText.from_pretrained(path)
    assert model.get_output_embeddings().weight.shape == (151_936, cfg.text_config.hidden_size)
    # The tokenizer stays the byte one: it never produces the ids past its own size.
    assert len(AutoProcessor.from_pretrained(path).tokenizer) == 256 + len(SPECIAL_TOKENS)


def test_a_vocabulary_narrower_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_qwen2_vl(tmp_path / "m", tokenizer="byte", vocab_size=100)
