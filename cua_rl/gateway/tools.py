"""Function calling: which format a chat template writes tool calls in, and parsing a reply.

The gateway renders ``tools`` through the model's own chat template; a template that writes
nothing for them (the original Qwen2-VL frame) serves no function calling. The families this
project trains (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) use Hermes-style calls: a reply is free text,
then ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. Parsing follows vLLM's
``hermes`` tool parser, so an agent gets the ``tool_calls`` it would get from vLLM serving the
same model: ``content`` is the text before the first ``<tool_call>`` (None when empty),
``arguments`` is the JSON of the parsed arguments (``ensure_ascii=False``), an unclosed last
block runs to the end of the text, and a reply whose blocks do not all parse is plain content
with no calls. Pure: no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

HERMES = "hermes"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``

    def openai(self, call_id: str | None = None) -> dict:
        return {
            "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    calls: tuple[ToolCall, ...]


def parse_hermes(text: str) -> ParsedReply:
    """A sampled reply -> its content and its Hermes tool calls (none: the whole text)."""
    if _HERMES_OPEN not in text:
        return ParsedReply(text, ())
    calls: list[ToolCall] = []
    for closed, unclosed in _HERMES_BLOCK.findall(text):
        try:
            call = json.loads(closed or unclosed)
            name, args = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            return ParsedReply(text, ())
        if not isinstance(name, str):
            return ParsedReply(text, ())
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    content = text[: text.index(_HERMES_OPEN)]
    return ParsedReply(content or None, tuple(calls))


PARSERS: dict[str, Callable[[str], ParsedReply]] = {HERMES: parse_hermes}

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_4f1c",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_format(render: Callable[..., str]) -> str | None:
    """The tool-call format a chat template writes, or None when it renders no tools.

    ``render(messages, tools)`` renders a conversation. A template serves function calling
    when the tools change what it writes, and its format is the one its instructions name."""
    messages = [{"role": "user", "content": "u"}]
    with_tools = render(messages, [_PROBE_TOOL])
    if with_tools == render(messages, None) or "probe_tool_4f1c" not in with_tools:
        return None
    if _HERMES_OPEN in with_tools and _HERMES_CLOSE in with_tools:
        return HERMES
    return None


def arguments_object(arguments):
    """OpenAI sends arguments as JSON text; templates write them from the object (as vLLM
    hands them over). Text that is not a JSON object stays text."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def canonical_arguments(arguments) -> str:
    """Arguments as a comparison key: the same object however the agent spaced its JSON."""
    value = arguments_object(arguments)
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
