"""A captured turn as OpenAI's chat-completion answer.

The message is the one the agent gets (content, and the tool calls parsed from the reply); a
reply with calls finishes ``tool_calls`` (vLLM's rule). Logprobs, when asked, are each sampled
token's (the one trained on) with its own ``bytes``, and the server's top candidates of the same
distribution when ``top_logprobs`` asks for them.
"""

from __future__ import annotations

import time
from typing import Any

from cua_rl.gateway.capture import CapturedTurn
from cua_rl.gateway.requests import token_bytes, top_logprobs


def chat_completion(turn: CapturedTurn, body: dict, tokenizer, model: str) -> dict:
    calls = turn.message.get("tool_calls")
    choice: dict[str, Any] = {
        "index": 0,
        "message": dict(turn.message),
        "finish_reason": "tool_calls" if calls else turn.finish_reason,
        "logprobs": None,
    }
    if body.get("logprobs"):
        choice["logprobs"] = {"content": _logprobs(turn, top_logprobs(body), tokenizer)}
    out: dict[str, Any] = {
        "id": turn.response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(turn.prompt_ids),
            "completion_tokens": len(turn.output_ids),
            "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
        },
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = list(turn.output_ids)
        out["prompt_token_ids"] = list(turn.prompt_ids)
    return out


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    return {
        "token": tokenizer.decode([token_id]),
        "logprob": logprob,
        "bytes": list(token_bytes(tokenizer, token_id)),
    }


def _logprobs(turn: CapturedTurn, k: int, tokenizer) -> list[dict]:
    tops = turn.top or [[] for _ in turn.output_ids]
    return [
        {
            **_entry(tokenizer, t, lp),
            "top_logprobs": [_entry(tokenizer, c, clp) for c, clp in top[:k]],
        }
        for t, lp, top in zip(turn.output_ids, turn.logprobs, tops, strict=True)
    ]
