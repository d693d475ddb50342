"""What one chat-completion request may ask, checked before anything is fetched or sampled.

The sampling settings are the trainer's: what the agent asked is compared with them through the
one rule (``Sampling.distribution``) and recorded, replaced or refused. Function calling is not
served yet, so requests that rely on it are refused rather than answered without their tools.
Token ``bytes`` for OpenAI's logprobs shape are each token's own bytes.
"""

from __future__ import annotations

import functools
import math
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
    "stop",
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


def refuse_tools(body: dict) -> None:
    """Function calling is not served yet: a request that relies on it is refused, never
    answered as if its tools were not there (the schema would not reach the prompt)."""
    if body.get("tools"):
        raise GatewayFailure(
            "this gateway does not render 'tools' or parse tool calls yet: send the actions as "
            "text",
            status=400,
            code="tools_unsupported",
        )
    for i, msg in enumerate(body.get("messages") or []):
        if isinstance(msg, dict) and (msg.get("tool_calls") or msg.get("role") == "tool"):
            raise GatewayFailure(
                f"messages[{i}] holds a tool call or a tool result, which this gateway does not "
                "render yet",
                status=400,
                code="tools_unsupported",
            )


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
