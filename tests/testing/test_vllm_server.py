"""A real vLLM CPU server answers chat completions with exact token data for an image prompt."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image


def _png_data_url(size=(360, 640), color=(30, 140, 220)) -> tuple[str, Image.Image]:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 40):  # some structure so the image is not a flat colour
        for y in range(size[1]):
            img.putpixel((x, y), (255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


@pytest.mark.slow
def test_chat_completion_returns_tokens_logprobs_and_image_pads(vllm_server, tiny_vl_model_dir):
    from transformers import AutoProcessor

    url, img = _png_data_url()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Open settings."},
            ],
        }
    ]
    body = {
        "model": vllm_server.model,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    resp = httpx.post(f"{vllm_server.base_url}/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    token_ids = choice["token_ids"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert 1 <= len(token_ids) <= 12
    assert len(logprobs) == len(token_ids)
    assert all(lp <= 0.0 for lp in logprobs)

    proc = AutoProcessor.from_pretrained(tiny_vl_model_dir)
    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Open settings."}]}
    ]
    text = proc.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    expected = proc(text=[text], images=[img], return_tensors="pt")
    expected_pads = int((expected["input_ids"] == image_pad).sum())
    merge = proc.image_processor.merge_size
    assert expected_pads == int(expected["image_grid_thw"][0].prod()) // (merge * merge)

    prompt_ids = data["prompt_token_ids"]
    assert prompt_ids.count(image_pad) == expected_pads
    assert prompt_ids == expected["input_ids"][0].tolist()
