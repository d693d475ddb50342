"""What one chat-completion request may ask, checked before anything is fetched or sampled.

The sampling settings are the trainer's: what the agent asked is compared with them through the
one rule (``Sampling.distribution``) and recorded, replaced or refused. Tools are
rendered only where the model's template writes tools, and ``tool_choice`` is honoured or
refused. ``stop`` and ``top_logprobs`` leave the distribution alone and are served.
Token ``bytes`` for OpenAI's logprobs shape are each token's own bytes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from cua_rl.errors import CuaRlError
from cua_rl.gateway.config import Sampling, top_k_neutral


class GatewayFailure(CuaRlError):
    """A call the gateway cannot serve; ``status`` and ``code`` shape the OpenAI error."""

    def __init__(
        self, message: str, *, status: int, code: str, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


# Request keys that change what is sampled. The trainer owns them.
TRAINER_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens")
# Keys the trainer never sets: present and non-empty, they are overridden (dropped).
FOREIGN_KEYS = (
    "min_p",
    "min_tokens",
    "seed",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "best_of",
)


def trainer_values(sampling: Sampling) -> dict[str, Any]:
    return {
        **sampling.distribution(),
        "max_tokens": sampling.max_new_tokens,
        "max_completion_tokens": sampling.max_new_tokens,
    }


def sampling_differences(body: dict, sampling: Sampling) -> tuple[dict, dict]:
    """(what the agent asked, the subset the trainer overrides)."""
    asked = {
        k: body[k] for k in (*TRAINER_KEYS, *FOREIGN_KEYS) if body.get(k) not in (None, [], {})
    }
    want = trainer_values(sampling)
    overridden = {}
    for key, value in asked.items():
        if key not in want:
            overridden[key] = value
            continue
        if key == "top_k" and isinstance(value, int) and top_k_neutral(value) and want[key] == -1:
            continue
        if not isinstance(value, int | float) or not math.isclose(float(value), float(want[key])):
            overridden[key] = value
    return asked, overridden


def check_tools(body: dict, tool_format: Callable[[], str | None]) -> tuple[list | None, bool]:
    """(the tools to render, whether to parse the reply for calls) for one request.

    ``tool_format()`` is the chat template's (``tools.template_format``); None: the template
    writes no tools, so a request that relies on them is refused, never answered as if they
    were not there. ``tool_choice`` "auto" (the default) parses the reply; "none" renders the
    same prompt (tools included, so the conversation's ids do not depend on it) and returns the
    text as content. "required" and a named function would need constrained decoding, which
    changes the distribution sampled from (the trainer's recompute would not match): refused.
    """
    tools = body.get("tools") or None
    history = any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
        for m in body.get("messages") or []
    )
    if tools is not None and (
        not isinstance(tools, list)
        or not all(
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise GatewayFailure(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ...}}',
            status=400,
            code="invalid_request",
        )
    if (tools or history) and tool_format() is None:
        raise GatewayFailure(
            "the served model's chat template writes no tools or tool calls, so function "
            "calling cannot be served: send the actions as text, or serve a model whose "
            "template has tools (Qwen2.5-VL, Qwen3-VL)",
            status=400,
            code="tools_unsupported",
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayFailure(
            f"tool_choice {json.dumps(choice)} cannot be honoured: forcing a call needs "
            "constrained decoding, which changes the distribution sampled from and so the "
            'logprobs the trainer learns from. Use "auto" (the model decides) or "none"',
            status=400,
            code="tool_choice_unsupported",
        )
    return tools, bool(tools) and choice != "none"


def stop_strings(body: dict) -> list[str]:
    """The agent's ``stop``: a string or up to 4 strings (OpenAI's limit)."""
    stop = body.get("stop")
    if stop is None or stop == []:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or not all(isinstance(x, str) and x for x in stops)
    ):
        raise GatewayFailure(
            "'stop' must be a non-empty string or a list of up to 4 of them",
            status=400,
            code="invalid_request",
        )
    return stops


def top_logprobs(body: dict) -> int:
    """How many candidates per token the agent asked for (0: none; OpenAI's range 0-20)."""
    k = body.get("top_logprobs")
    if k is None or not body.get("logprobs"):
        return 0
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20:
        raise GatewayFailure(
            "'top_logprobs' must be an integer from 0 to 20", status=400, code="invalid_request"
        )
    return k


def cut_at_stop(ids: Sequence[int], decode: Callable[[list[int]], str], stops: list[str]):
    """How many of ``ids`` the agent receives: the longest prefix whose text ends before the
    first stop string (a token that holds part of it is dropped), or None when no stop string
    occurs. The row keeps exactly these tokens, so it matches the text the agent got."""
    text = decode(list(ids))
    found = [i for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    end = min(found)
    keep = 0
    while keep < len(ids) and len(decode(list(ids[: keep + 1]))) <= end:
        keep += 1
    return keep


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character; this maps them back."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = dict(zip(printable, printable, strict=True))
    extra = 256
    for b in range(256):
        if b not in spelled:
            spelled[b], extra = extra, extra + 1
    return {chr(c): b for b, c in spelled.items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes (a piece of a UTF-8 character stays that piece, as OpenAI gives it);
    tokenizers that are not byte-level fall back to the decoded text's UTF-8."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    decoder = _byte_decoder()
    if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    return tokenizer.decode([token_id]).encode("utf-8")
