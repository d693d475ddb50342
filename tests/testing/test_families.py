"""The production families' tiny models: their chat templates write the documented format, and the
gateway's turn-by-turn ids of a multi-turn episode with screenshots and tool calls equal what
transformers' ``apply_chat_template`` + the processor give for the whole conversation."""

from __future__ import annotations

import io

import pytest
from PIL import Image as PILImage

from cua_rl.gateway.render import Conversation
from cua_rl.testing.cache import FAMILY_KINDS, ensure_model
from tests.gateway.test_render import _data_url, _png, _turn, _user

# The Hermes function-calling system block, as the families document it.
TOOLS_TEXT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "mobile_use", "parameters": {}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
CALL = '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "click", "coordinate": [5, 7]}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "mobile_use", "parameters": {}}}]


@pytest.fixture(scope="module", params=FAMILY_KINDS)
def family(request):
    from transformers import AutoProcessor

    return request.param, AutoProcessor.from_pretrained(ensure_model(request.param))


def _conversation():
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Open wifi"}]},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The toggle is top left.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "mobile_use",
                        "arguments": {"action": "click", "coordinate": [5, 7]},
                    },
                }
            ],
        },
        {"role": "tool", "content": [{"type": "image"}]},
        {"role": "tool", "content": "done"},
    ]


def test_template_writes_the_documented_format(family):
    kind, processor = family
    text = processor.apply_chat_template(
        _conversation(), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    # Qwen2.5-VL opens with its default system message; Qwen3-VL has none. Qwen3-VL writes the
    # reasoning as a think block; Qwen2.5-VL has no such convention and drops it.
    system = "You are a helpful assistant.\n\n" if kind == "qwen2.5-vl" else ""
    think = "<think>\nThe toggle is top left.\n</think>\n\n" if kind != "qwen2.5-vl" else ""
    expected = (
        f"<|im_start|>system\n{system}{TOOLS_TEXT}<|im_end|>\n"
        f"<|im_start|>user\n{IMG}Open wifi<|im_end|>\n"
        f"<|im_start|>assistant\n{think}{CALL}<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{IMG}\n</tool_response>\n"
        "<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected


def test_without_tools_only_qwen2_5_adds_a_system_message(family):
    kind, processor = family
    text = processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    body = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert text == (head + body if kind == "qwen2.5-vl" else body)


def test_gateway_ids_of_a_multi_turn_episode_equal_the_whole_conversation_rendered(family):
    """Three turns, a screenshot each, replies that are tool calls written as text (as the model
    samples them): the stored ids equal the processor's ids of the whole conversation."""
    _, processor = family
    conv = Conversation.for_processor(processor)
    system = {"role": "system", "content": "You operate a phone."}
    msgs = [system]
    replies = [
        CALL,
        '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "swipe"}}\n</tool_call>',
        "done",
    ]
    pngs = [_png((10 * i, 20, 30), size=(96 + 32 * i, 160)) for i in range(3)]
    for i, reply_text in enumerate(replies):
        msgs.append(_user(f"Step {i + 1}", _data_url(pngs[i])))
        _, ids, out, reply = _turn(conv, processor, msgs, reply_text)
        assert reply == reply_text
        msgs.append({"role": "assistant", "content": reply})
    stored = ids + out

    whole = [system]
    for i, reply_text in enumerate(replies):
        whole.append(
            {
                "role": "user",
                "content": [{"type": "text", "text": f"Step {i + 1}"}, {"type": "image"}],
            }
        )
        whole.append({"role": "assistant", "content": reply_text})
    text = processor.apply_chat_template(whole, tokenize=False)
    images = [PILImage.open(io.BytesIO(raw)).convert("RGB") for raw in pngs]
    expected = processor(text=[text], images=images, return_tensors="pt")["input_ids"][0]
    # The template ends the last reply with "<|im_end|>\n"; the sampled ids end at <|im_end|>.
    assert stored == expected.tolist()[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_builder_is_deterministic(tmp_path, kind):
    import hashlib

    from cua_rl.testing.families import build_tiny_vl_family

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}

    a = build_tiny_vl_family(tmp_path / "a", kind, seed=3)
    b = build_tiny_vl_family(tmp_path / "b", kind, seed=3)
    c = build_tiny_vl_family(tmp_path / "c", kind, seed=4)
    assert digests(a) == digests(b)
    assert digests(a)["model.safetensors"] != digests(c)["model.safetensors"]


def test_a_trainer_saved_moe_is_rewritten_in_the_released_layout(tmp_path):
    """What a disk weight update hands vLLM: the trainer saves with transformers (fused experts
    as [E, out, in]); the worker extension turns them back into the released file's tensors,
    once (a second pass changes nothing)."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen3VLMoeForConditionalGeneration

    from cua_rl.inference.vllm_worker import experts_in_released_layout

    released = ensure_model("qwen3-vl-moe")
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(released, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    assert experts_in_released_layout(str(tmp_path)) == 4  # 2 layers x (gate_up, down)
    assert experts_in_released_layout(str(tmp_path)) == 0
    with (
        safe_open(str(released / "model.safetensors"), "pt") as want,
        safe_open(str(tmp_path / "model.safetensors"), "pt") as got,
    ):
        for key in want.keys():  # noqa: SIM118 (a safetensors handle)
            assert torch.equal(want.get_tensor(key), got.get_tensor(key)), key
