"""Function-calling parsing and template detection, checked against vLLM's own Hermes parser.

vLLM's parser runs in vLLM's interpreter (``CUA_VLLM_PYTHON``) on the same texts; the gateway's
pure parser must give the same content and calls for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from cua_rl.gateway.tools import (
    HERMES,
    canonical_arguments,
    parse_hermes,
    template_format,
)
from cua_rl.testing.cache import ensure_model

CALL = '<tool_call>\n{"name": "tap", "arguments": {"x": 10, "y": 20}}\n</tool_call>'
TEXTS = {
    "single call": CALL,
    "two calls": CALL + '\n<tool_call>\n{"name": "type", "arguments": {"text": "héllo"}}\n'
    "</tool_call>",
    "text before": "I will tap the button.\n" + CALL,
    "text after": CALL + " and then some",
    "malformed JSON": '<tool_call>\n{"name": "tap", "arguments": {"x": }\n</tool_call>',
    "no call": "Just words, no call.",
    "unclosed last block": 'thinking<tool_call>\n{"name": "home", "arguments": {}}',
    "no arguments key": '<tool_call>{"name": "home"}</tool_call>',
    "non-string name": '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "empty block": "<tool_call></tool_call>",
    "not an object": "<tool_call>[1, 2]</tool_call>",
    "null arguments": '<tool_call>{"name": "home", "arguments": null}</tool_call>',
    "string arguments": '<tool_call>{"name": "t", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "one good one bad": CALL + "<tool_call>{oops}</tool_call>",
}

VLLM_SIDE = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoTokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    parser = Hermes2ProToolParser(AutoTokenizer.from_pretrained(sys.argv[1]))
    out = {}
    for name, text in json.load(sys.stdin).items():
        info = parser.extract_tool_calls(text, None)
        out[name] = {
            "content": info.content,
            "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls],
        }
    print(json.dumps(out))
    """
)


def _ours(text: str) -> dict:
    parsed = parse_hermes(text)
    return {"content": parsed.content, "calls": [[c.name, c.arguments] for c in parsed.calls]}


@pytest.mark.slow
def test_the_parser_agrees_with_vllms_hermes_parser_on_every_text():
    python = os.environ.get("CUA_VLLM_PYTHON")
    if not python:
        pytest.fail("CUA_VLLM_PYTHON must name vLLM's interpreter for this check")
    done = subprocess.run(
        [python, "-c", VLLM_SIDE, str(ensure_model("qwen2.5-vl"))],
        input=json.dumps(TEXTS),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    agree = [name for name in TEXTS if theirs[name] == _ours(TEXTS[name])]
    assert agree == list(TEXTS), {n: (theirs[n], _ours(TEXTS[n])) for n in TEXTS if n not in agree}
    # The set exercises both outcomes: calls found, and text left as content.
    assert sum(bool(theirs[n]["calls"]) for n in TEXTS) >= 5
    assert sum(not theirs[n]["calls"] for n in TEXTS) >= 5


def test_calls_and_content_are_split_as_openai_gives_them():
    parsed = parse_hermes(TEXTS["text before"])
    assert parsed.content == "I will tap the button.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("tap", {"x": 10, "y": 20})
    ]
    assert parse_hermes(CALL).content is None
    assert parse_hermes(TEXTS["malformed JSON"]).calls == ()


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("qwen2-vl-bpe", None),
        ("qwen2.5-vl", HERMES),
        ("qwen3-vl", HERMES),
        ("qwen3-vl-moe", HERMES),
    ],
)
def test_each_family_template_is_detected_by_what_it_renders(kind, expected):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_model(kind))

    def render(messages, tools):
        return tok.apply_chat_template(messages, tools=tools, tokenize=False)

    assert template_format(render) == expected


def test_arguments_compare_by_their_object_not_their_spacing():
    assert canonical_arguments('{"b": 1,"a": 2}') == canonical_arguments({"a": 2, "b": 1})
    assert canonical_arguments("not json") == "not json"
