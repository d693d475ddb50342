"""The local gym's HTTP side: the genv endpoints, the sim-only device endpoints, faults, health.

Routes only translate: a ``SimGym`` does the work. Device errors become answers here: a
malformed action is a 400, a device that broke fails its execution with a 409 naming the
reason (``cua_rl/sim/device.py``). The app's lifespan starts the backend (the browser, for the
browser backend) and, on the way out, terminates every execution still open before stopping it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import asdict

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from cua_rl.errors import ConfigError
from cua_rl.sim.device import ActionError, DeviceFailure
from cua_rl.sim.gym_state import OPS, Execution, Fault, SimGym

BASE = "/api/v1/{gym_id}"


class DropConnection(Exception):
    """Raised after the response has started so uvicorn closes the socket mid-answer."""


class _HideInjectedDrops(logging.Filter):
    """Injected drops are expected; keep uvicorn from logging each one as a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DropConnection)


_DROP_FILTER = _HideInjectedDrops()


class _DroppingResponse(Response):
    """Starts a response then aborts it, so the client sees the connection die mid-answer."""

    async def __call__(self, scope, receive, send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"execution', "more_body": True})
        raise DropConnection("injected dropped connection")


def _answer(gym: SimGym, request: Request, body: dict) -> Response:
    if getattr(request.state, "drop", False):
        gym.counters["drops"] += 1
        return _DroppingResponse()
    return JSONResponse(body)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise HTTPException(400, detail=f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise HTTPException(400, detail="body must be a JSON object")
    return body


def create_app(gym: SimGym) -> FastAPI:
    cfg = gym.config

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        async def sweeper() -> None:
            while True:
                await asyncio.sleep(min(1.0, cfg.idle_ttl_s / 4))
                await gym.sweep()

        gym.loop = asyncio.get_running_loop()
        await gym.backend.start()
        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()
            await gym.close_all()
            gym.close_spill()
            await gym.backend.stop()

    app = FastAPI(title="cua-rl sim gym", lifespan=lifespan)
    err_log = logging.getLogger("uvicorn.error")
    if _DROP_FILTER not in err_log.filters:
        err_log.addFilter(_DROP_FILTER)
    app.state.gym = gym
    _service_routes(app, gym)
    _task_routes(app, gym)
    _execution_routes(app, gym)
    _device_routes(app, gym)
    return app


def _check_gym(gym: SimGym, gym_id: str) -> None:
    if gym_id != gym.config.gym_id:
        raise HTTPException(
            404, detail=f"unknown gym id {gym_id!r}; this server serves {gym.config.gym_id!r}"
        )


def _service_routes(app: FastAPI, gym: SimGym) -> None:
    cfg = gym.config

    @app.get("/healthz")
    async def healthz() -> dict:
        return {
            "ok": True,
            "gym_id": cfg.gym_id,
            "backend": cfg.backend,
            "live": len(gym.live),
            "counters": gym.counters,
            "screenshots": {
                "memory_bytes": gym.memory_screenshot_bytes(),
                "retained_executions": len(gym.retained),
                "retained_bytes": gym.retained_bytes,
                "disk_bytes": gym.spill.disk_bytes,
            },
            "delaying": {op: n for op, n in gym.delaying.items() if n},
        }

    @app.get("/api/v1/_sim/faults")
    async def get_faults() -> dict:
        return {op: asdict(cfg.faults.get(op, Fault())) for op in OPS}

    @app.put("/api/v1/_sim/faults")
    async def put_faults(request: Request) -> dict:
        body = await _json_body(request)
        try:
            new = {op: Fault(**spec) for op, spec in body.items() if op in OPS}
            unknown = set(body) - set(OPS)
            if unknown:
                raise ConfigError(f"unknown operations {sorted(unknown)}; use {', '.join(OPS)}")
        except (TypeError, ConfigError) as e:
            raise HTTPException(400, detail=str(e)) from None
        cfg.faults.update(new)
        return {op: asdict(cfg.faults.get(op, Fault())) for op in OPS}


def _task_routes(app: FastAPI, gym: SimGym) -> None:
    @app.get(BASE + "/tasks")
    async def list_tasks(gym_id: str) -> dict:
        _check_gym(gym, gym_id)
        return {"tasks": gym.backend.entries()}

    @app.get(BASE + "/tasks/{task_id}")
    async def get_task(gym_id: str, task_id: str) -> dict:
        _check_gym(gym, gym_id)
        detail = gym.backend.detail(task_id)
        if detail is None:
            raise HTTPException(404, detail=f"unknown task {task_id!r}")
        return detail

    @app.post(BASE + "/tasks/{task_id}")
    async def create_execution(gym_id: str, task_id: str, request: Request) -> Response:
        _check_gym(gym, gym_id)
        body = await _json_body(request)
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise HTTPException(400, detail="options must be an object")
        await gym.inject("create", request)
        ex = await gym.create(task_id, options)
        answer = {
            "execution_id": ex.execution_id,
            "box_id": f"simbox-{ex.execution_id[3:]}",
            "task_id": task_id,
            "status": "running",
        }
        utterance = getattr(ex.device, "utterance", None)
        if utterance:
            answer["instruction"] = utterance
        return _answer(gym, request, answer)


def _execution_routes(app: FastAPI, gym: SimGym) -> None:
    @app.get(BASE + "/executions")
    async def list_executions(gym_id: str) -> dict:
        _check_gym(gym, gym_id)
        return {
            "executions": [
                {
                    "execution_id": e.execution_id,
                    "task_id": e.task_id,
                    "created_at": e.created_at,
                    "last_active_at": e.last_active_at,
                    "status": "failed" if e.failure else e.status,
                    "failure": e.failure,
                }
                for e in gym.live.values()
            ]
        }

    @app.post(BASE + "/executions/{execution_id}/evaluate")
    async def evaluate(gym_id: str, execution_id: str, request: Request) -> Response:
        _check_gym(gym, gym_id)
        body = await _json_body(request)
        answer = body.get("answer_text")
        if answer is not None and not isinstance(answer, str):
            raise HTTPException(400, detail="answer_text must be a string")
        gym.get(execution_id)
        gym.counters["evaluations"] += 1
        await gym.inject("evaluate", request)
        ex = gym.get(execution_id)  # it may have been terminated during the injected latency
        async with ex.lock:
            result = await _on_device(gym, ex, ex.device.evaluate(answer))
        return _answer(
            gym, request, {"success": True, "execution_id": execution_id, "result": result}
        )

    @app.post(BASE + "/executions/{execution_id}/terminate")
    async def terminate(gym_id: str, execution_id: str, request: Request) -> Response:
        _check_gym(gym, gym_id)
        if execution_id not in gym.live and execution_id not in gym.retained:
            raise HTTPException(404, detail=f"execution {execution_id} is unknown")
        await gym.inject("terminate", request)
        closed = await gym.terminate(execution_id)
        return _answer(
            gym,
            request,
            {
                "success": True,
                "execution_id": execution_id,
                "status": "terminated",
                "already_terminated": not closed,
            },
        )


async def _on_device(gym: SimGym, ex: Execution, call):
    """Await a device call: a malformed action is a 400, a broken device fails the execution."""
    try:
        return await call
    except ActionError as e:
        raise HTTPException(400, detail=str(e)) from None
    except DeviceFailure:
        raise gym.note_failure(ex) from None


def _device_routes(app: FastAPI, gym: SimGym) -> None:
    cfg = gym.config

    @app.post(BASE + "/executions/{execution_id}/screenshot")
    async def screenshot(gym_id: str, execution_id: str, request: Request) -> dict:
        _check_gym(gym, gym_id)
        ex = gym.get(execution_id)
        async with ex.lock:
            if len(ex.screenshots) >= cfg.max_screenshots:
                raise HTTPException(
                    409,
                    detail=f"execution {execution_id} reached {cfg.max_screenshots} screenshots",
                )
            png = await _on_device(gym, ex, ex.device.screenshot())
            if gym.live.get(execution_id) is not ex:
                # Terminated meanwhile: its screenshots were spilled without this one.
                raise HTTPException(409, detail=f"execution {execution_id} is terminated")
            ex.screenshots.append(png)
            index = len(ex.screenshots) - 1
        url = (
            str(request.base_url).rstrip("/")
            + f"/api/v1/{gym_id}/executions/{execution_id}/screenshots/{index}.png"
        )
        return {
            "index": index,
            "url": url,
            "data_url": "data:image/png;base64," + base64.b64encode(png).decode("ascii"),
            "width": ex.device.width,
            "height": ex.device.height,
        }

    @app.get(BASE + "/executions/{execution_id}/screenshots/{index}.png")
    async def get_screenshot(gym_id: str, execution_id: str, index: int) -> Response:
        _check_gym(gym, gym_id)
        png = gym.screenshot_bytes(execution_id, index)
        if png is None:
            raise HTTPException(
                404,
                detail=f"no screenshot {index} for execution {execution_id} "
                "(never taken or past retention)",
            )
        return Response(
            png,
            media_type="image/png",
            headers={"Cache-Control": "public, max-age=31536000, immutable"},
        )

    @app.post(BASE + "/executions/{execution_id}/actions")
    async def act(gym_id: str, execution_id: str, request: Request) -> dict:
        _check_gym(gym, gym_id)
        body = await _json_body(request)
        ex = gym.get(execution_id)
        name, args = body.get("name"), body.get("args", {})
        keyed = hasattr(ex.device, "state_key")
        async with ex.lock:
            before = await _on_device(gym, ex, ex.device.state_key()) if keyed else None
            error = await _on_device(gym, ex, ex.device.act(name, {} if args is None else args))
            after = await _on_device(gym, ex, ex.device.state_key()) if keyed else None
        answer = {"ok": error is None, "error": error, "screen": ex.device.label()}
        if keyed:
            # The states the action was applied to and left (docs/gym.md, *State keys*), and
            # whether it changed anything (docs/audit.md).
            answer.update(state_key_before=before, state_key_after=after, changed=before != after)
        return answer
