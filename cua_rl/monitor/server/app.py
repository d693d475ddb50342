"""The monitor's HTTP API: ``POST /api/ingest/batch`` (the batch of cua_rl/monitor/protocol.py),
the reads of the read model, the screenshot store (``PUT``/``GET /api/screenshots/<sha256>``)
and the dashboard pages. Routes are installed per resource by small functions.

Every error, from any layer (auth, body limit, JSON, validation, routing), has one shape:
``{"error": {"code": ..., "message": ..., "details": ...}}``. The body limit is enforced while
reading the stream, so an oversized body is never held in memory. Store calls run in worker
threads; the store serialises writes itself and the read model gives each thread its own
read connection.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import BATCH_KEY_HEADER, IMAGE_KIND, ScreenshotError
from cua_rl.monitor.server import audits, episodes
from cua_rl.monitor.server.dashboard import DEFAULT_STALE_AFTER_S, DashboardAuth, install_dashboard
from cua_rl.monitor.server.read import MonitorReader
from cua_rl.monitor.server.safety import DEFAULT_HEARTBEAT_TIMEOUT_S
from cua_rl.monitor.server.screenshots import ScreenshotStore
from cua_rl.monitor.server.store import IngestValidationError, MonitorStore

try:  # orjson is several times faster on large batches; the stdlib is the fallback.
    import orjson

    def _loads(data: bytes) -> Any:
        return orjson.loads(data)

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, default=str)

    _JSON_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError, UnicodeDecodeError)
except ImportError:  # pragma: no cover - depends on the environment

    def _loads(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, default=str, separators=(",", ":")).encode()

    _JSON_ERRORS = (json.JSONDecodeError, UnicodeDecodeError)

log = get_logger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details: Any = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, code: str, message: str, details: Any = None, headers=None) -> Response:
    body = {"error": {"code": code, "message": message, "details": details}}
    return _json(body, status, headers)


_STATUS_CODES = {
    400: "bad_request",
    415: "unsupported_media_type",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    422: "validation_error",
}


def create_app(
    store: MonitorStore,
    *,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    screenshots: ScreenshotStore | None = None,
    dashboard: bool = True,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    heartbeat_timeout_s: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> FastAPI:
    """The ASGI app over ``store``: the API, the screenshot store (``screenshots``; default: a
    store beside the database) and the dashboard pages. With ``token`` set, every route but
    ``/healthz`` and ``/login`` needs it (Bearer, or the dashboard's session cookie for reads).
    The safety net's reaper (cua_rl/monitor/server/safety.py) runs at startup and then every
    tenth of ``heartbeat_timeout_s`` (at most every 30 s); None turns the reaping off (open
    records under ended trainings are still closed at startup)."""
    app = FastAPI(title="cua-rl Training Monitor", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store = store
    if screenshots is None:
        screenshots = ScreenshotStore(store.path)
        app.router.on_shutdown.append(screenshots.close)
    app.state.screenshots = screenshots
    auth = DashboardAuth(token)
    _install_error_handlers(app)

    @app.get("/healthz")
    async def healthz():
        return _json({"ok": True})

    _install_reaper(app, store, heartbeat_timeout_s)
    _install_ingest(app, store, auth, max_body_bytes, screenshots)
    _install_trainings(app, store.read, auth)
    _install_rollouts(app, store.read, auth)
    _install_screenshots(app, screenshots, auth, max_body_bytes)
    _install_episodes(app, store.read, auth)
    _install_audits(app, store.read, auth)
    if dashboard:
        install_dashboard(
            app, store.path, auth, stale_after_s=stale_after_s, screenshots_root=screenshots.root
        )
    return app


def _install_reaper(app: FastAPI, store: MonitorStore, timeout_s: float | None) -> None:
    tasks: list[asyncio.Task] = []

    async def reap_once() -> None:
        try:
            done = await anyio.to_thread.run_sync(store.reap, timeout_s)
        except Exception:  # the next pass tries again; the API keeps serving meanwhile
            log.exception("monitor: the safety net's pass failed")
            return
        for training_id, closed in done["closed"].items():
            log.warning(
                "monitor: closed open records of ended training %s: %s", training_id, closed
            )
        for r in done["reaped"]:
            log.warning(
                "monitor: training %s (%s) failed: heartbeat silent for %.0f s",
                r["id"], r["run_name"], r["silent_s"],
            )  # fmt: skip

    async def loop(every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await reap_once()

    async def start() -> None:
        await reap_once()
        if timeout_s is not None:
            tasks.append(asyncio.create_task(loop(min(30.0, max(0.2, timeout_s / 10)))))

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.code, exc.message, exc.details, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = _STATUS_CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else code
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return _error(exc.status_code, code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        details = [
            {"field": ".".join(str(p) for p in e.get("loc", ())), "message": e.get("msg")}
            for e in exc.errors()
        ]
        return _error(422, "validation_error", "invalid request parameters", details)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("monitor: unhandled error on %s %s", request.method, request.url.path)
        return _error(500, "internal_error", f"{type(exc).__name__}: {exc}")


def _check_auth(auth: DashboardAuth, request: Request, *, read: bool = True) -> None:
    # Reads also take the dashboard's session cookie; writes only the Bearer token.
    why = auth.reader(request) if read else auth.bearer(request)
    if why == "missing":
        raise ApiError(401, "unauthorized", "missing Authorization: Bearer <project token>")
    if why is not None:
        raise ApiError(401, "unauthorized", "wrong project token")


def _too_large(message: str, limit: int) -> ApiError:
    return ApiError(413, "body_too_large", message, {"limit": limit})


async def _read_body(request: Request, limit: int, hint: str = "") -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes: never held whole."""
    hint = hint or "send smaller batches"
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(
            f"body of {length} bytes exceeds the limit of {limit} bytes; {hint}", limit
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"body exceeds the limit of {limit} bytes; {hint}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _str_param(request: Request, name: str) -> str:
    """A required, non-empty query parameter (422 naming it otherwise)."""
    value = request.query_params.get(name, "")
    if not value:
        raise ApiError(422, "validation_error", f"{name} is required", {"field": name})
    return value


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(
            422, "validation_error", f"{name} must be an integer", {"field": name}
        ) from None
    if not lo <= value <= hi:
        raise ApiError(422, "validation_error", f"{name} must be in [{lo}, {hi}]", {"field": name})
    return value


async def _in_thread(fn, *args, **kwargs):
    return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def _one_by_id(auth: DashboardAuth, request: Request, get, kind: str, row_id: int):
    """``{kind: row}`` of ``get(row_id)`` in a thread; 404 when there is no such row."""
    _check_auth(auth, request)
    row = await _in_thread(get, row_id)
    if row is None:
        raise ApiError(404, "not_found", f"no {kind} with id {row_id}")
    return _json({kind: row})


def _install_ingest(
    app: FastAPI, store: MonitorStore, auth: DashboardAuth, limit: int, shots: ScreenshotStore
) -> None:
    @app.post("/api/ingest/batch")
    async def ingest(request: Request):
        _check_auth(auth, request, read=False)
        body = await _read_body(request, limit)
        try:
            batch = _loads(body)
        except _JSON_ERRORS as exc:
            raise ApiError(400, "bad_json", f"the body is not valid JSON: {exc}") from None
        try:
            # The warehouse's images go to the screenshot store first (content-addressed, so a
            # batch sent again stores nothing twice); the episodes naming them follow.
            images = batch.pop(IMAGE_KIND, None) if isinstance(batch, dict) else None
            if images is not None:
                await anyio.to_thread.run_sync(episodes.put_images, images, shots.put)
            key = request.headers.get(BATCH_KEY_HEADER)
            result = await anyio.to_thread.run_sync(store.ingest, batch, key)
        except IngestValidationError as exc:
            raise ApiError(422, "validation_error", str(exc), exc.details()) from None
        return _json(result)


def _install_trainings(app: FastAPI, read: MonitorReader, auth: DashboardAuth) -> None:
    @app.get("/api/trainings")
    async def trainings(request: Request):
        _check_auth(auth, request)
        limit = _int_param(request, "limit", 50, 1, 1000)
        before = request.query_params.get("before_id")
        before_id = _int_param(request, "before_id", 0, 0, 2**62) if before else None
        rows = await _in_thread(read.list_trainings, limit=limit, before_id=before_id)
        return _json({"trainings": rows})

    @app.get("/api/trainings/{training_id}")
    async def training(request: Request, training_id: int):
        return await _one_by_id(auth, request, read.get_training, "training", training_id)

    @app.get("/api/status-history/{entity_type}/{entity_id}")
    async def status_history(request: Request, entity_type: str, entity_id: int):
        _check_auth(auth, request)
        try:
            rows = await _in_thread(read.status_history, entity_type, entity_id)
        except ValueError as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        return _json({"entity_type": entity_type, "entity_id": entity_id, "history": rows})

    @app.get("/api/task-outcomes")
    async def task_outcomes(request: Request):
        _check_auth(auth, request)
        run_name = _str_param(request, "run_name")
        # A run not recorded yet has no outcomes (not a 404: that means a wrong URL).
        training_id, rows = await _in_thread(read.task_outcomes, run_name)
        return _json({"run_name": run_name, "training_id": training_id, "outcomes": rows})


def _install_rollouts(app: FastAPI, read: MonitorReader, auth: DashboardAuth) -> None:
    async def rollouts_of(request: Request, source: str, source_id: int):
        _check_auth(auth, request)
        limit = _int_param(request, "limit", 500, 1, 5000)
        after_id = _int_param(request, "after_id", 0, 0, 2**62)
        rows = await _in_thread(
            read.list_rollouts, source, source_id, limit=limit, after_id=after_id
        )
        if rows is None:
            raise ApiError(404, "not_found", f"no {source} with id {source_id}")
        return _json({"rollouts": rows})

    @app.get("/api/steps/{step_id}/rollouts")
    async def step_rollouts(request: Request, step_id: int):
        return await rollouts_of(request, "step", step_id)

    @app.get("/api/evals/{eval_id}/rollouts")
    async def eval_rollouts(request: Request, eval_id: int):
        return await rollouts_of(request, "eval", eval_id)

    @app.get("/api/baselines/{baseline_id}/rollouts")
    async def baseline_rollouts(request: Request, baseline_id: int):
        return await rollouts_of(request, "baseline", baseline_id)

    @app.get("/api/rollouts/{rollout_id}")
    async def rollout(request: Request, rollout_id: int):
        return await _one_by_id(auth, request, read.get_rollout, "rollout", rollout_id)


def _install_episodes(app: FastAPI, read: MonitorReader, auth: DashboardAuth) -> None:
    @app.get("/api/episodes/successes")
    async def successes(request: Request):
        """A task's stored successes for replay (``MonitorClient.successes``)."""
        _check_auth(auth, request)
        task_id = _str_param(request, "task_id")
        trainings = request.query_params.getlist("training")
        min_version = _int_param(request, "min_version", -1, -1, 2**62)
        max_version = _int_param(request, "max_version", 2**62, -1, 2**62)
        limit = _int_param(request, "limit", 1, 1, 100)

        def query():
            found, skipped = episodes.successes(
                read.conn(), task_id, trainings, min_version, limit, max_version
            )
            return [episodes.to_json(r, _screenshot_path) for r in found], dict(skipped)

        try:
            found, skipped = await _in_thread(query)
        except episodes.NoEpisodeStore as exc:
            raise ApiError(409, "no_episode_store", str(exc)) from None
        return _json({"task_id": task_id, "episodes": found, "skipped": skipped})


def _install_audits(app: FastAPI, read: MonitorReader, auth: DashboardAuth) -> None:
    """Verifier audits (``python -m cua_rl.audit``, docs/audit.md)."""

    @app.get("/api/audits")
    async def list_audits(request: Request):
        _check_auth(auth, request)
        gym_id = request.query_params.get("gym_id", "")
        limit = _int_param(request, "limit", 50, 1, 1000)
        rows = await _in_thread(lambda: audits.list_audits(read.conn(), gym_id=gym_id, limit=limit))
        return _json({"audits": rows})

    @app.get("/api/audits/flagged")
    async def flagged(request: Request):
        """The newest completed audit of a gym and its flagged tasks (``curriculum.skip_flagged``)."""
        _check_auth(auth, request)
        gym_id = _str_param(request, "gym_id")
        audit, tasks = await _in_thread(lambda: audits.flagged_tasks(read.conn(), gym_id))
        return _json({"gym_id": gym_id, "audit": audit, "tasks": tasks})

    @app.get("/api/audits/{audit_id}")
    async def audit(request: Request, audit_id: int):
        return await _one_by_id(
            auth, request, lambda i: audits.get_audit(read.conn(), i), "audit", audit_id
        )


def _screenshot_path(sha256: str) -> str:
    return f"/api/screenshots/{sha256}"


def _install_screenshots(
    app: FastAPI, screenshots: ScreenshotStore, auth: DashboardAuth, max_body_bytes: int
) -> None:
    @app.put("/api/screenshots/{sha256}")
    async def put_screenshot(request: Request, sha256: str):
        _check_auth(auth, request, read=False)
        body = await _read_body(
            request,
            min(max_body_bytes, screenshots.max_image_bytes),
            "downscale the image (the recorder keeps the long edge at most 1024 px)",
        )
        try:
            created = await anyio.to_thread.run_sync(screenshots.put, sha256, body)
        except ScreenshotError as exc:
            status = {"not_an_image": 415, "too_large": 413}.get(exc.code, 422)
            code = {415: "unsupported_media_type", 413: "body_too_large"}.get(status, exc.code)
            raise ApiError(status, code, str(exc)) from None
        return _json(
            {"sha256": sha256, "created": created, "bytes": len(body)}, 201 if created else 200
        )

    @app.get("/api/screenshots/{sha256}")
    async def get_screenshot(request: Request, sha256: str):
        _check_auth(auth, request)
        found = await anyio.to_thread.run_sync(screenshots.get, sha256)
        if found is None:
            raise ApiError(404, "not_found", f"no screenshot {sha256[:64]}")
        path, mime = found
        # Content-addressed: the bytes under a name never change.
        return FileResponse(
            path,
            media_type=mime,
            headers={
                "Cache-Control": "private, max-age=31536000, immutable",
                "X-Content-Type-Options": "nosniff",
            },
        )
