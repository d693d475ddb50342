"""Chat templates of the Qwen vision-language families, written here from their documented formats.

All of them share the ChatML frame (``<|im_start|>role\\n ... <|im_end|>\\n``) and write an image
part as ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor and vLLM expand the pad to
the image's token count). They differ where a released checkpoint's template differs:

- ``QWEN2_VL``: the frame only (the original tiny models' template, kept for their tests).
- ``QWEN2_5_VL``: the Qwen2-VL conversation (a default system message "You are a helpful
  assistant." when the conversation has none) plus Hermes-style function calling: the tools are
  listed as JSON in the system message between ``<tools></tools>``, an assistant's calls are
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks after its text, and
  consecutive ``tool`` messages become one user turn of ``<tool_response>`` blocks.
- ``QWEN3_VL``: the same tool convention, no default system message, and the Qwen3 reasoning
  convention: an assistant message's ``reasoning_content`` is written before its text as
  ``<think>\\n...\\n</think>\\n\\n``. (Instruct checkpoints, MAI-UI's base, open no think block
  in the generation prompt.) Content parts may be images or text in every role, tool results
  included.

Templates are Jinja strings for ``tokenizer.chat_template``; transformers and vLLM render them.
"""

from __future__ import annotations

from cua_rl.agent.flavours.toolcall import TOOLS_POSTAMBLE, TOOLS_PREAMBLE

# Every image part, whatever the role; text parts verbatim.
_CONTENT = (
    "{%- macro content(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') or 'image' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

QWEN2_VL = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _jinja_str(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _template(default_system: str | None, thinking: bool) -> str:
    """One Qwen family template; ``default_system`` opens a conversation that has no system
    message, ``thinking`` writes ``reasoning_content`` as a think block."""
    first_is_system = "messages and messages[0]['role'] == 'system'"
    default = _jinja_str(default_system) if default_system is not None else None
    system = (
        "{%- if tools -%}"
        "{{- '<|im_start|>system\\n' -}}"
        f"{{%- if {first_is_system} -%}}{{{{- content(messages[0]['content']) + '\\n\\n' -}}}}"
        + (f"{{%- else -%}}{{{{- {default} + '\\n\\n' -}}}}" if default else "")
        + "{%- endif -%}"
        f"{{{{- {_jinja_str(TOOLS_PREAMBLE)} -}}}}"
        "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
        f"{{{{- {_jinja_str(TOOLS_POSTAMBLE)} + '<|im_end|>\\n' -}}}}"
        f"{{%- elif {first_is_system} -%}}"
        "{{- '<|im_start|>system\\n' + content(messages[0]['content']) + '<|im_end|>\\n' -}}"
        + (
            f"{{%- else -%}}{{{{- '<|im_start|>system\\n' + {default} + '<|im_end|>\\n' -}}}}"
            if default
            else ""
        )
        + "{%- endif -%}"
    )
    reasoning = (
        "{%- if message.get('reasoning_content') -%}"
        "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        if thinking
        else ""
    )
    calls = (
        "{%- for call in message.get('tool_calls') or [] -%}"
        "{%- set fn = call['function'] if 'function' in call else call -%}"
        "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n' -}}"
        "{{- '{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
        "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
        "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
    )
    body = (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' and loop.first -%}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
        "{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + content(message['content']) + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
        "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}" + reasoning + "{{- content(message['content']) -}}"
        "" + calls + "{{- '<|im_end|>\\n' -}}"
        "{%- else -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content(message['content']) -}}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    return _CONTENT + system + body


QWEN2_5_VL = _template("You are a helpful assistant.", thinking=False)
QWEN3_VL = _template(None, thinking=True)

TEMPLATES = {"qwen2-vl": QWEN2_VL, "qwen2.5-vl": QWEN2_5_VL, "qwen3-vl": QWEN3_VL}
