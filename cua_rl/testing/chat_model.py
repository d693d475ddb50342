"""A scripted OpenAI-style chat model for the local agent: its replies in turn, vLLM's token data.

``POST /v1/chat/completions`` answers the next reply of ``replies`` (the last one again once they
run out; a fresh script per ``episode_len`` calls when set), with ``prompt_token_ids`` (a length
growing with the call, as a growing context's does), ``token_ids`` and a logprob per token, the
fields the local agent records. Counts the calls. Serve it with ``cua_rl.serving.ThreadedServer``
(``ScriptedChatModel(...).server``).
"""

from __future__ import annotations

from fastapi import FastAPI

from cua_rl.serving import ThreadedServer


class ScriptedChatModel:
    def __init__(
        self,
        replies: tuple[str, ...] = ("tap(300, 116)", 'finished("done")'),
        *,
        prompt_ids_per_call: int = 500,
        episode_len: int | None = None,
    ):
        self.replies = replies
        self.calls = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete() -> dict:
            turn = self.calls % episode_len if episode_len else self.calls
            text = replies[min(turn, len(replies) - 1)]
            self.calls += 1
            ids = list(range(300, 300 + len(text)))
            return {
                "id": f"cmpl-{self.calls}",
                "prompt_token_ids": list(range(1000, 1000 + prompt_ids_per_call * (turn + 1))),
                "choices": [
                    {
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                        "token_ids": ids,
                        "logprobs": {"content": [{"logprob": -0.5} for _ in ids]},
                    }
                ],
            }

        self.server = ThreadedServer(app, name="scripted-chat-model")
