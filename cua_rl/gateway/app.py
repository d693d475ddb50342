"""The gateway's HTTP surface: an OpenAI-compatible base URL per episode.

``/episodes/{episode_id}/v1`` serves ``POST /chat/completions`` (plain or ``stream: true``, which
gets the whole answer, tool calls included, as one chunk) and ``GET /models``. Every failure answers OpenAI's error
shape, ``{"error": {"message", "type", "param", "code"}}``, so agents built on the OpenAI SDK
report it as such: 404 for an episode the gateway does not know (or has closed), 413 for a body
over the limit (checked while reading, before parsing), 400 for malformed JSON or a request it
will not serve, 502 when the model server keeps failing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cua_rl.gateway.requests import GatewayFailure
from cua_rl.gateway.session import ClientGone, Clients, EpisodeSession


def _error_body(message: str, code: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def openai_error(status: int, message: str, code: str, kind: str = "invalid_request_error"):
    return JSONResponse(_error_body(message, code, kind), status_code=status)


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


RETRY_HEADER = "x-stainless-retry-count"


def retry_count(request: Request) -> int:
    """The official OpenAI SDKs' (Python and npm) attempt number: 0 on the first send of a
    request, n on its n-th automatic retry; absent from other clients (0)."""
    raw = request.headers.get(RETRY_HEADER)
    if raw is None:
        return 0
    if not raw.strip().isdigit():
        raise ValueError(f"{RETRY_HEADER} must be a non-negative integer, got {raw!r}")
    return int(raw)


def _chunks(answer: dict) -> list[dict]:
    choice = answer["choices"][0]
    base = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if calls := choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    first = {
        **base,
        "choices": [
            {
                "index": 0,
                "delta": delta,
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
    return [first, last]


async def _disconnected(request: Request) -> None:
    """Completes when the client goes away (the body is read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _stream(call: Awaitable[dict], keepalive_s: float) -> AsyncIterator[str]:
    """The event stream opens at once and carries an SSE comment every ``keepalive_s`` while
    the call waits (a pause can take minutes; proxies and clients drop silent connections)."""

    async def events():
        task = asyncio.ensure_future(call)
        try:
            yield ": waiting for the model\n\n"
            while not task.done():
                await asyncio.wait({task}, timeout=keepalive_s)
                if not task.done():
                    yield ": keep-alive\n\n"
            try:
                chunks = _chunks(task.result())
            except GatewayFailure as exc:
                chunks = [_error_body(str(exc), exc.code, exc.kind)]
            except ClientGone:
                return
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            task.cancel()

    return events()


def pooled(max_connections: int) -> httpx.AsyncClient:
    """One episode has at most one call in flight: a pool of one connection per concurrent
    episode never makes a call queue. No pool timeout: a call waits for a connection rather
    than failing after httpx's default 5 s (its own time limits still apply)."""
    n = max_connections or None
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n or 256)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, pool=None))


def _chat_route(app: FastAPI, lookup, state: dict, max_body_bytes: int, keepalive_s: float):
    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, request: Request):
        session = lookup(episode_id)
        if session is None:
            return _unknown(episode_id)
        try:
            raw = await read_body(request, max_body_bytes)
        except BodyTooLarge as exc:
            return openai_error(413, str(exc), "request_too_large")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return openai_error(400, f"the body is not JSON: {exc}", "invalid_json")
        try:
            retry = retry_count(request)
        except ValueError as exc:
            return openai_error(400, str(exc), "invalid_request")
        # An SDK's retry re-sends the same bytes: the hash and the retry count tell a re-send
        # from a new call (an agent may ask the same request again on purpose).
        key = hashlib.sha256(raw).hexdigest()
        call = session.chat(
            body, state["clients"], key=key, retry=retry, gone=lambda: _disconnected(request)
        )
        if isinstance(body, dict) and body.get("stream"):
            return StreamingResponse(_stream(call, keepalive_s), media_type="text/event-stream")
        task = asyncio.current_task()
        session.inflight.add(task)
        try:
            answer = await call
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except GatewayFailure as exc:
            return openai_error(exc.status, str(exc), exc.code, exc.kind)
        finally:
            session.inflight.discard(task)
        return JSONResponse(answer)


def _model_routes(app: FastAPI, lookup, models: Callable[[str], list[str]]) -> None:
    def model_list(episode_id: str) -> list[dict] | None:
        session = lookup(episode_id)
        if session is None:
            return None
        created = int(session.capture.opened_at)
        return [
            {"id": m, "object": "model", "created": created, "owned_by": "cua-rl"}
            for m in models(episode_id)
        ]

    @app.get("/episodes/{episode_id}/v1/models")
    async def list_models(episode_id: str):
        data = model_list(episode_id)
        return _unknown(episode_id) if data is None else {"object": "list", "data": data}

    @app.get("/episodes/{episode_id}/v1/models/{model:path}")
    async def get_model(episode_id: str, model: str):
        data = model_list(episode_id)
        if data is None:
            return _unknown(episode_id)
        found = [m for m in data if m["id"] == model]
        if not found:
            return openai_error(404, f"the model {model!r} does not exist", "model_not_found")
        return found[0]


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return openai_error(exc.status_code, message, code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return openai_error(400, f"invalid request: {exc.errors()}", "invalid_request")


def _unknown(episode_id: str):
    return openai_error(
        404,
        f"no open episode {episode_id!r} on this gateway (it ended, or the URL is wrong)",
        "episode_not_found",
    )


def create_app(
    lookup: Callable[[str], EpisodeSession | None],
    *,
    max_body_bytes: int,
    models: Callable[[str], list[str]],
    client_factory: Callable[[], httpx.AsyncClient] | None = None,
    keepalive_s: float = 15.0,
    max_connections: int = 0,
) -> FastAPI:
    """``lookup(episode_id)`` finds an open episode; the app owns the model-server and image
    clients, one pool each (``max_connections`` each, 0: unbounded, as AReaL's own client)."""
    state: dict[str, Clients] = {}

    @asynccontextmanager
    async def lifespan(app):
        state["clients"] = Clients(
            (client_factory or (lambda: pooled(max_connections)))(), pooled(max_connections)
        )
        try:
            yield
        finally:
            await state["clients"].model.aclose()
            await state["clients"].images.aclose()

    app = FastAPI(title="cua-rl rollout gateway", lifespan=lifespan)
    _chat_route(app, lookup, state, max_body_bytes, keepalive_s)
    _model_routes(app, lookup, models)
    _error_handlers(app)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    return app
