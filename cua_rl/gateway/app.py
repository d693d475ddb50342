"""The gateway's HTTP surface: an OpenAI-compatible base URL per episode.

``/episodes/{episode_id}/v1`` serves ``POST /chat/completions`` (plain or ``stream: true``, which
gets the whole answer as one chunk) and ``GET /models``. Every failure answers OpenAI's error
shape, ``{"error": {"message", "type", "param", "code"}}``, so agents built on the OpenAI SDK
report it as such: 404 for an episode the gateway does not know (or has closed), 413 for a body
over the limit (checked while reading, before parsing), 400 for malformed JSON or a request it
will not serve, 502 when the model server keeps failing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cua_rl.gateway.session import EpisodeSession, GatewayFailure


def openai_error(status: int, message: str, code: str, kind: str = "invalid_request_error"):
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body of {declared} bytes > limit {limit}")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(f"body over the limit of {limit} bytes")
    return bytes(buf)


def _sse(answer: dict) -> Any:
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    first = {
        **base,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": choice["message"]["content"]},
                "logprobs": choice.get("logprobs"),
                "finish_reason": None,
            }
        ],
    }
    last = {
        **base,
        "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
    }
    last["usage"] = answer["usage"]

    async def events():
        for event in (first, last):
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return events()


def create_app(
    lookup: Callable[[str], EpisodeSession | None],
    *,
    max_body_bytes: int,
    models: Callable[[str], list[str]],
    client_factory: Callable[[], httpx.AsyncClient] | None = None,
) -> FastAPI:
    """``lookup(episode_id)`` finds an open episode; the app owns the model-server client."""
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app):
        state["client"] = (client_factory or httpx.AsyncClient)()
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="cua-rl rollout gateway", lifespan=lifespan)

    def unknown(episode_id: str):
        return openai_error(
            404,
            f"no open episode {episode_id!r} on this gateway (it ended, or the URL is wrong)",
            "episode_not_found",
        )

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, request: Request):
        session = lookup(episode_id)
        if session is None:
            return unknown(episode_id)
        try:
            raw = await read_body(request, max_body_bytes)
        except BodyTooLarge as exc:
            return openai_error(413, str(exc), "request_too_large")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return openai_error(400, f"the body is not JSON: {exc}", "invalid_json")
        task = asyncio.current_task()
        session.inflight.add(task)
        try:
            answer = await session.chat(body, state["client"])
        except GatewayFailure as exc:
            return openai_error(exc.status, str(exc), exc.code, exc.kind)
        finally:
            session.inflight.discard(task)
        if isinstance(body, dict) and body.get("stream"):
            return StreamingResponse(_sse(answer), media_type="text/event-stream")
        return JSONResponse(answer)

    @app.get("/episodes/{episode_id}/v1/models")
    async def list_models(episode_id: str):
        if lookup(episode_id) is None:
            return unknown(episode_id)
        data = [{"id": m, "object": "model", "owned_by": "cua-rl"} for m in models(episode_id)]
        return {"object": "list", "data": data}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    return app
