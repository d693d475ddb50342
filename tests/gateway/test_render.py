"""The gateway's conversation state: tokens in, tokens out, with the tiny BPE Qwen2-VL's own
processor and chat template (no server: expanded prompts are simulated as the processor makes them)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image as PILImage

from cua_rl.gateway.render import (
    BadRequest,
    Conversation,
    Image,
    collapse_pads,
    image_sources,
    normalize,
    sniff_mime,
)


@pytest.fixture(scope="module")
def processor(tiny_vl_bpe_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)


def _png(color, size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def _data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def _user(text: str, url: str | None = None) -> dict:
    parts = [{"type": "text", "text": text}]
    if url:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "user", "content": parts}


def _images(messages) -> dict[str, Image]:
    out = {}
    for src in image_sources(messages):
        raw = base64.b64decode(src.split(",", 1)[1])
        out[src] = Image.of(raw, src)
    return out


def _expand(processor, ids: list[int], images: list[Image]) -> list[int]:
    """What the server returns as the prompt: each single pad expanded to the image's tokens."""
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grids = (
        processor.image_processor(
            images=[PILImage.open(io.BytesIO(i.data)).convert("RGB") for i in images],
            return_tensors="pt",
        )["image_grid_thw"]
        if images
        else []
    )
    counts = iter([int(g.prod()) // 4 for g in grids])
    out: list[int] = []
    for t in ids:
        out.extend([pad] * next(counts) if t == pad else [t])
    return out


def _turn(conv, processor, messages, output_text: str, stop: bool = True):
    template, images, key = normalize(messages, _images(messages))
    prompt = conv.prompt(template, images, key)
    expanded = _expand(processor, prompt.send_ids, images)
    tok = processor.tokenizer
    out = tok.encode(output_text, add_special_tokens=False)
    if stop:
        out.append(tok.convert_tokens_to_ids("<|im_end|>"))
    reply = tok.decode(out, skip_special_tokens=True)
    conv.commit(template, key, expanded, out, reply, prompt.segment)
    return prompt, expanded, out, reply


def test_follow_up_turns_extend_the_stored_ids_exactly(processor):
    conv = Conversation.for_processor(processor)
    msgs = [{"role": "system", "content": "You operate a phone."}]
    msgs.append(_user("Step 1", _data_url(_png((10, 20, 30)))))
    # A reply whose BPE re-tokenisation differs from the sampled ids: the sampled ids must stay.
    p1, ids1, out1, reply1 = _turn(conv, processor, msgs, "tap(1, 2) é")
    assert p1.expected_prefix is None and p1.segment == 1
    msgs += [
        {"role": "assistant", "content": reply1},
        _user("Step 2", _data_url(_png((200, 0, 0)))),
    ]
    p2, ids2, out2, reply2 = _turn(conv, processor, msgs, "back()")
    assert p2.expected_prefix == ids1 + out1
    assert ids2[: len(ids1) + len(out1)] == ids1 + out1
    assert p2.segment == 1
    # What follows the stored ids is exactly what the template writes after the reply,
    # rendered once: the full render of the same conversation ends the same way.
    full = processor.apply_chat_template(
        [
            {"role": "system", "content": "You operate a phone."},
            {"role": "user", "content": [{"type": "text", "text": "Step 1"}, {"type": "image"}]},
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": [{"type": "text", "text": "Step 2"}, {"type": "image"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    tail = full[full.index("<|im_end|>", full.index(reply1)) :]
    tok = processor.tokenizer
    # The sampled <|im_end|> is not repeated.
    assert collapse_pads(ids2[len(ids1) + len(out1) :], -1) == _expand(
        processor, tok.encode(tail[len("<|im_end|>") :], add_special_tokens=False), p2.images[1:]
    )


def test_edited_history_starts_a_new_segment(processor):
    conv = Conversation.for_processor(processor)
    msgs = [_user("Step 1", _data_url(_png((1, 2, 3))))]
    _, _, _, reply = _turn(conv, processor, msgs, "tap(5, 5)")
    # The agent changed its own earlier reply: the stored ids no longer describe the history.
    edited = [*msgs, {"role": "assistant", "content": reply + " (edited)"}, _user("Step 2")]
    p2, *_ = _turn(conv, processor, edited, "home()")
    assert p2.expected_prefix is None and p2.segment == 2
    # Dropping the first screenshot (history truncation) also starts afresh.
    msgs3 = [_user("Step 1"), {"role": "assistant", "content": "home()"}, _user("Step 3")]
    p3, *_ = _turn(conv, processor, msgs3, "back()")
    assert p3.segment == 3


def test_same_screenshot_under_a_new_url_still_extends(processor):
    conv = Conversation.for_processor(processor)
    raw = _png((9, 9, 9))
    msgs = [_user("Step 1", _data_url(raw))]
    _, ids1, out1, reply = _turn(conv, processor, msgs, "wait(1)")
    # Presigned URLs change; the image is compared by its bytes. A different data URL of the
    # same bytes (another base64 line break style is not possible, so re-encode the header).
    same = "data:image/png;base64," + base64.b64encode(raw).decode()
    msgs2 = [_user("Step 1", same), {"role": "assistant", "content": reply}, _user("Step 2")]
    p2, *_ = _turn(conv, processor, msgs2, "back()")
    assert p2.expected_prefix == ids1 + out1


def test_reply_cut_by_length_is_closed_by_the_template(processor):
    conv = Conversation.for_processor(processor)
    msgs = [_user("Step 1")]
    _, ids1, out1, reply = _turn(conv, processor, msgs, "tap(1", stop=False)
    msgs2 = [*msgs, {"role": "assistant", "content": reply}, _user("Step 2")]
    p2, ids2, *_ = _turn(conv, processor, msgs2, "x")
    im_end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # No sampled <|im_end|>: the template's own closes the reply in the prompt.
    assert ids2[len(ids1) + len(out1)] == im_end


def test_collapse_pads_keeps_one_pad_per_run():
    assert collapse_pads([1, 7, 7, 7, 2, 7, 3, 7, 7], 7) == [1, 7, 2, 7, 3, 7]


def test_malformed_messages_are_refused():
    with pytest.raises(BadRequest, match="non-empty list"):
        normalize([], {})
    with pytest.raises(BadRequest, match="role"):
        normalize([{"content": "x"}], {})
    with pytest.raises(BadRequest, match="audio"):
        normalize([{"role": "user", "content": [{"type": "input_audio", "x": 1}]}], {})
    with pytest.raises(BadRequest, match="not PNG"):
        sniff_mime(b"GIF8" + b"x" * 20)
    assert sniff_mime(_png((0, 0, 0))) == "image/png"


def test_follow_up_ids_keep_a_split_a_full_re_render_would_merge(processor):
    """The ids sent for turn 2 are turn 1's prompt + its sampled ids + the new messages rendered
    on their own. The sampled ids here split "tap" into characters (as a model may sample it):
    re-rendering the whole conversation tokenises the same text canonically, and differs."""
    tok = processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    conv = Conversation.for_processor(processor)
    msgs = [{"role": "system", "content": "You operate a phone."}]
    msgs.append(_user("Step 1", _data_url(_png((10, 20, 30)))))
    template, images, key = normalize(msgs, _images(msgs))
    ids1 = _expand(processor, conv.prompt(template, images, key).send_ids, images)
    text = "tap(4, 2)"
    out = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)] + [im_end]
    assert out[:-1] != tok.encode(text, add_special_tokens=False)  # a non-canonical split
    reply = tok.decode(out, skip_special_tokens=True)
    assert reply == text
    conv.commit(template, key, ids1, out, reply, 1)

    msgs2 = [
        *msgs,
        {"role": "assistant", "content": reply},
        _user("Step 2", _data_url(_png((200, 0, 0)))),
    ]
    template2, images2, key2 = normalize(msgs2, _images(msgs2))
    p2 = conv.prompt(template2, images2, key2)
    sent = _expand(processor, p2.send_ids, images2)

    full_text = processor.apply_chat_template(
        [
            {"role": "system", "content": "You operate a phone."},
            {"role": "user", "content": [{"type": "text", "text": "Step 1"}, {"type": "image"}]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": [{"type": "text", "text": "Step 2"}, {"type": "image"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    # What the template writes after the reply's <|im_end|>: the new messages, rendered once.
    tail = full_text[full_text.index("<|im_end|>", full_text.index(reply)) + len("<|im_end|>") :]
    new = _expand(processor, tok.encode(tail, add_special_tokens=False), images2[1:])
    assert sent == ids1 + out + new

    full = _expand(processor, tok.encode(full_text, add_special_tokens=False), images2)
    assert tok.decode(full) == tok.decode(sent)  # the same text ...
    assert full != sent  # ... but not the ids the model sampled
    assert full[: len(ids1)] == ids1 and full[len(ids1) : len(ids1) + len(out)] != out
