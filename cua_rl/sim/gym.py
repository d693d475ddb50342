"""A local gym server that speaks the genv protocol over the simulated phone.

``python -m cua_rl.sim gym --host 127.0.0.1 --port N [--gym-id sim]`` serves the genv endpoints
(docs/design.md: same paths, bodies and answer shapes) plus the sim-only endpoints documented in
docs/conventions.md (screenshots, actions, execution listing, fault injection, health).

Design:
- ``SimGym`` owns all state: live executions (each its own ``Phone``), screenshots kept after
  terminate for a bounded retention (they stand in for presigned object-store URLs), a cap on
  live executions and a sweeper that expires idle ones (the only cleanup a real gym has for an
  execution whose creator vanished).
- Faults are injected per operation (create / evaluate / terminate): latency first, then a 500
  with ``detail``, then the real work, then optionally a dropped connection. Dropping *after*
  the work is the worst case on purpose: a dropped create leaves a live execution the client
  never heard of, exactly the leak the client and the idle expiry must cope with.
- ``GymServer`` runs the app with uvicorn in a thread on a free loopback port for tests and
  demos; ``main`` runs it in the foreground and prints one ``ready`` line with the base URL.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import random
import sys
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger
from cua_rl.serving import ThreadedServer
from cua_rl.sim.phone import (
    TASKS,
    TASKS_BY_ID,
    ActionError,
    Phone,
    SimTask,
    initial_state,
    run_validators,
)

log = get_logger(__name__)
OPS = ("create", "evaluate", "terminate")


@dataclass
class Fault:
    fail_rate: float = field(
        default=0.0, metadata={"help": "probability of answering 500 without doing the work"}
    )
    latency_s: float = field(
        default=0.0, metadata={"help": "seconds to wait before handling the call"}
    )
    drop_rate: float = field(
        default=0.0,
        metadata={"help": "probability of dropping the connection after the work is done"},
    )

    def __post_init__(self) -> None:
        for name in ("fail_rate", "drop_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"fault {name}={v!r} must be a probability in [0, 1]")
        if (
            isinstance(self.latency_s, bool)
            or not isinstance(self.latency_s, int | float)
            or not 0.0 <= self.latency_s <= 600
        ):
            raise ConfigError(f"fault latency_s={self.latency_s!r} must be seconds in [0, 600]")


@dataclass
class SimGymConfig:
    gym_id: str = field(
        default="sim", metadata={"help": "the {gym_id} path segment this server answers for"}
    )
    seed: int = field(
        default=0, metadata={"help": "seeds every execution's initial state and the fault dice"}
    )
    max_live: int = field(
        default=256, metadata={"help": "live executions allowed at once; more creates answer 429"}
    )
    idle_ttl_s: float = field(
        default=900.0, metadata={"help": "an execution untouched this long is expired (terminated)"}
    )
    screenshot_retention_s: float = field(
        default=3600.0, metadata={"help": "how long screenshots stay fetchable after terminate"}
    )
    max_retained_executions: int = field(
        default=4096,
        metadata={
            "help": "terminated executions whose screenshots are kept (oldest dropped first)"
        },
    )
    max_screenshots: int = field(
        default=512, metadata={"help": "screenshots one execution may capture"}
    )
    max_retained_bytes: int = field(
        default=512 * 1024 * 1024,
        metadata={"help": "PNG bytes kept for terminated executions (oldest dropped first)"},
    )
    width: int = field(default=360, metadata={"help": "screenshot width in pixels"})
    height: int = field(default=640, metadata={"help": "screenshot height in pixels"})
    faults: dict[str, Fault] = field(
        default_factory=dict,
        metadata={"help": "per-operation fault injection: create, evaluate, terminate"},
    )

    def __post_init__(self) -> None:
        if not self.gym_id or "/" in self.gym_id:
            raise ConfigError(
                f"gym_id={self.gym_id!r} must be a non-empty path segment such as 'sim'"
            )
        if self.max_live < 1:
            raise ConfigError(f"max_live={self.max_live} must be at least 1")
        if self.idle_ttl_s <= 0 or self.screenshot_retention_s < 0:
            raise ConfigError("idle_ttl_s must be > 0 and screenshot_retention_s >= 0 (seconds)")
        if (
            min(self.max_retained_executions, self.max_retained_bytes) < 0
            or self.max_screenshots < 1
        ):
            raise ConfigError(
                "max_retained_executions and max_retained_bytes must be >= 0, max_screenshots >= 1"
            )
        if not (120 <= self.width <= 4096 and 200 <= self.height <= 4096):
            raise ConfigError(
                f"screen {self.width}x{self.height} must be within 120x200 .. 4096x4096"
            )
        unknown = set(self.faults) - set(OPS)
        if unknown:
            raise ConfigError(
                f"faults for unknown operations {sorted(unknown)}; use {', '.join(OPS)}"
            )
        self.faults = {
            op: f if isinstance(f, Fault) else Fault(**f) for op, f in self.faults.items()
        }


@dataclass
class Execution:
    execution_id: str
    task: SimTask
    phone: Phone
    created_at: float
    last_active_at: float
    screenshots: list[bytes] = field(default_factory=list)
    status: str = "running"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class DropConnection(Exception):
    """Raised after the response has started so uvicorn closes the socket mid-answer."""


class _HideInjectedDrops(logging.Filter):
    """Injected drops are expected; keep uvicorn from logging each one as a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, DropConnection)


_DROP_FILTER = _HideInjectedDrops()


class SimGym:
    def __init__(self, config: SimGymConfig | None = None):
        self.config = config or SimGymConfig()
        self.live: dict[str, Execution] = {}
        # Terminated executions' screenshots: id -> (expires_at, screenshots), oldest first.
        self.retained: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()
        self.retained_bytes = 0
        self.counters = {
            "created": 0,
            "evaluations": 0,
            "terminated": 0,
            "expired": 0,
            "rejected_cap": 0,
            "faults": 0,
            "drops": 0,
        }
        self._dice = random.Random(f"faults:{self.config.seed}")

    # -- state ------------------------------------------------------------------------------
    def task_entry(self, t: SimTask) -> dict:
        return {
            "task_id": t.task_id,
            "name": t.name,
            "task_number": t.number,
            "description": t.description,
            "tags": [t.difficulty, t.app],
        }

    def task_detail(self, t: SimTask) -> dict:
        # The detail is richer than the list entry, as the real server's is.
        return {
            **self.task_entry(t),
            "instruction": t.description,
            "meta": {
                "id": t.task_id,
                "number": t.number,
                "displayName": t.name.replace("_", " ").title(),
                "description": t.description,
            },
            "env_config": {
                "type": "sim-phone",
                "width": self.config.width,
                "height": self.config.height,
                "start_screen": "home",
            },
            "evaluation": {"validators": [{"id": v.id, "weight": v.weight} for v in t.validators]},
            "seed_id": f"{t.name}-seed",
        }

    def get(self, execution_id: str) -> Execution:
        ex = self.live.get(execution_id)
        if ex is None:
            gone = execution_id in self.retained
            raise HTTPException(
                409 if gone else 404,
                detail=f"execution {execution_id} is {'terminated' if gone else 'unknown'}",
            )
        ex.last_active_at = time.time()
        return ex

    def create(self, task_id: str, options: dict) -> Execution:
        task = TASKS_BY_ID.get(task_id)
        if task is None:
            raise HTTPException(
                404, detail=f"unknown task {task_id!r}; GET /tasks lists the {len(TASKS)} tasks"
            )
        if len(self.live) >= self.config.max_live:
            self.counters["rejected_cap"] += 1
            raise HTTPException(
                429,
                detail=f"too many live executions ({len(self.live)}/{self.config.max_live}); terminate some or raise --max-live",
            )
        seed = options.get("seed", self.config.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise HTTPException(400, detail="options.seed must be an integer")
        now = time.time()
        ex = Execution(
            execution_id=f"ex-{uuid.uuid4().hex[:16]}",
            task=task,
            phone=Phone(initial_state(task, seed), self.config.width, self.config.height),
            created_at=now,
            last_active_at=now,
        )
        self.live[ex.execution_id] = ex
        self.counters["created"] += 1
        return ex

    def terminate(self, execution_id: str, status: str = "terminated") -> bool:
        """Close an execution; False when it was already closed (terminate is idempotent)."""
        ex = self.live.pop(execution_id, None)
        if ex is None:
            return False
        ex.status = status
        self.counters["expired" if status == "expired" else "terminated"] += 1
        self.retained[execution_id] = (
            time.time() + self.config.screenshot_retention_s,
            ex.screenshots,
        )
        self.retained_bytes += sum(len(b) for b in ex.screenshots)
        self._trim_retained()
        return True

    def _trim_retained(self) -> None:
        now = time.time()
        while self.retained:
            oldest, (expires, _) = next(iter(self.retained.items()))
            cfg = self.config
            if (
                expires > now
                and len(self.retained) <= cfg.max_retained_executions
                and self.retained_bytes <= cfg.max_retained_bytes
            ):
                break
            _, shots = self.retained.pop(oldest)
            self.retained_bytes -= sum(len(b) for b in shots)

    def sweep(self) -> int:
        cutoff = time.time() - self.config.idle_ttl_s
        stale = [eid for eid, ex in self.live.items() if ex.last_active_at < cutoff]
        for eid in stale:
            self.terminate(eid, status="expired")
        self._trim_retained()
        return len(stale)

    def screenshot_bytes(self, execution_id: str, index: int) -> bytes | None:
        shots = self.live[execution_id].screenshots if execution_id in self.live else None
        if shots is None and execution_id in self.retained:
            expires, shots = self.retained[execution_id]
            if expires < time.time():
                return None
        if shots is None or not 0 <= index < len(shots):
            return None
        return shots[index]

    async def inject(self, op: str, request: Request) -> None:
        """Latency and failure before the work; the drop decision is taken here, applied after."""
        f = self.config.faults.get(op)
        request.state.drop = False
        if f is None:
            return
        if f.latency_s:
            await asyncio.sleep(f.latency_s)
        if f.fail_rate and self._dice.random() < f.fail_rate:
            self.counters["faults"] += 1
            raise HTTPException(500, detail=f"injected {op} failure")
        if f.drop_rate and self._dice.random() < f.drop_rate:
            request.state.drop = True


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
                gym.sweep()

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="cua-rl sim gym", lifespan=lifespan)
    err_log = logging.getLogger("uvicorn.error")
    if _DROP_FILTER not in err_log.filters:
        err_log.addFilter(_DROP_FILTER)
    app.state.gym = gym
    base = "/api/v1/{gym_id}"

    def check_gym(gym_id: str) -> None:
        if gym_id != cfg.gym_id:
            raise HTTPException(
                404, detail=f"unknown gym id {gym_id!r}; this server serves {cfg.gym_id!r}"
            )

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "gym_id": cfg.gym_id, "live": len(gym.live), "counters": gym.counters}

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

    @app.get(base + "/tasks")
    async def list_tasks(gym_id: str) -> dict:
        check_gym(gym_id)
        return {"tasks": [gym.task_entry(t) for t in TASKS]}

    @app.get(base + "/tasks/{task_id}")
    async def get_task(gym_id: str, task_id: str) -> dict:
        check_gym(gym_id)
        t = TASKS_BY_ID.get(task_id)
        if t is None:
            raise HTTPException(404, detail=f"unknown task {task_id!r}")
        return gym.task_detail(t)

    @app.post(base + "/tasks/{task_id}")
    async def create_execution(gym_id: str, task_id: str, request: Request) -> Response:
        check_gym(gym_id)
        body = await _json_body(request)
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise HTTPException(400, detail="options must be an object")
        await gym.inject("create", request)
        ex = gym.create(task_id, options)
        return _answer(
            gym,
            request,
            {
                "execution_id": ex.execution_id,
                "box_id": f"simbox-{ex.execution_id[3:]}",
                "task_id": task_id,
                "status": "running",
            },
        )

    @app.get(base + "/executions")
    async def list_executions(gym_id: str) -> dict:
        check_gym(gym_id)
        return {
            "executions": [
                {
                    "execution_id": e.execution_id,
                    "task_id": e.task.task_id,
                    "created_at": e.created_at,
                    "last_active_at": e.last_active_at,
                }
                for e in gym.live.values()
            ]
        }

    @app.post(base + "/executions/{execution_id}/evaluate")
    async def evaluate(gym_id: str, execution_id: str, request: Request) -> Response:
        check_gym(gym_id)
        body = await _json_body(request)
        answer = body.get("answer_text")
        if answer is not None and not isinstance(answer, str):
            raise HTTPException(400, detail="answer_text must be a string")
        gym.get(execution_id)
        gym.counters["evaluations"] += 1
        await gym.inject("evaluate", request)
        ex = gym.get(execution_id)  # it may have been terminated during the injected latency
        async with ex.lock:
            result = run_validators(ex.task, ex.phone.state, answer)
        return _answer(
            gym, request, {"success": True, "execution_id": execution_id, "result": result}
        )

    @app.post(base + "/executions/{execution_id}/terminate")
    async def terminate(gym_id: str, execution_id: str, request: Request) -> Response:
        check_gym(gym_id)
        if execution_id not in gym.live and execution_id not in gym.retained:
            raise HTTPException(404, detail=f"execution {execution_id} is unknown")
        await gym.inject("terminate", request)
        closed = gym.terminate(execution_id)
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

    @app.post(base + "/executions/{execution_id}/screenshot")
    async def screenshot(gym_id: str, execution_id: str, request: Request) -> dict:
        check_gym(gym_id)
        ex = gym.get(execution_id)
        async with ex.lock:
            if len(ex.screenshots) >= cfg.max_screenshots:
                raise HTTPException(
                    409,
                    detail=f"execution {execution_id} reached {cfg.max_screenshots} screenshots",
                )
            # Rendering takes milliseconds of CPU; off the loop so other executions keep moving.
            png = await asyncio.to_thread(ex.phone.render_png)
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
            "width": cfg.width,
            "height": cfg.height,
        }

    @app.get(base + "/executions/{execution_id}/screenshots/{index}.png")
    async def get_screenshot(gym_id: str, execution_id: str, index: int) -> Response:
        check_gym(gym_id)
        png = gym.screenshot_bytes(execution_id, index)
        if png is None:
            raise HTTPException(
                404,
                detail=f"no screenshot {index} for execution {execution_id} (never taken or past retention)",
            )
        return Response(
            png,
            media_type="image/png",
            headers={"Cache-Control": "public, max-age=31536000, immutable"},
        )

    @app.post(base + "/executions/{execution_id}/actions")
    async def act(gym_id: str, execution_id: str, request: Request) -> dict:
        check_gym(gym_id)
        body = await _json_body(request)
        ex = gym.get(execution_id)
        name, args = body.get("name"), body.get("args", {})
        async with ex.lock:
            try:
                error = ex.phone.act(name, args if args is not None else {})
            except ActionError as e:
                raise HTTPException(400, detail=str(e)) from None
        return {"ok": error is None, "error": error, "screen": ex.phone.state.screen}

    return app


class GymServer(ThreadedServer):
    """The sim gym on a free loopback port in a background thread: ``with GymServer() as g``."""

    def __init__(
        self,
        config: SimGymConfig | None = None,
        host: str = "127.0.0.1",
        log_level: str = "warning",
        port: int = 0,
    ):
        self.gym = SimGym(config)
        super().__init__(
            create_app(self.gym), host=host, port=port, name="sim-gym", log_level=log_level
        )

    @property
    def gym_id(self) -> str:
        return self.gym.config.gym_id

    @property
    def base_url(self) -> str:
        return f"{self.url}/api/v1/{self.gym_id}"

    def start(self, timeout: float = 20.0) -> GymServer:
        super().start(timeout)
        return self


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cua_rl.sim gym",
        description="Local genv-compatible gym over a simulated phone.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=8800, help="0 picks a free port (printed on the ready line)"
    )
    p.add_argument("--gym-id", default="sim")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-live", type=int, default=256)
    p.add_argument(
        "--idle-ttl", type=float, default=900.0, help="seconds before an idle execution expires"
    )
    p.add_argument(
        "--screenshot-retention",
        type=float,
        default=3600.0,
        help="seconds screenshots stay fetchable after terminate",
    )
    p.add_argument("--width", type=int, default=360)
    p.add_argument("--height", type=int, default=640)
    p.add_argument("--log-level", default="warning")
    for op in OPS:
        p.add_argument(f"--{op}-fail-rate", type=float, default=0.0)
        p.add_argument(f"--{op}-latency", type=float, default=0.0, help="seconds")
        p.add_argument(f"--{op}-drop-rate", type=float, default=0.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    faults = {}
    for op in OPS:
        f = {
            k: getattr(args, f"{op}_{a}")
            for k, a in (
                ("fail_rate", "fail_rate"),
                ("latency_s", "latency"),
                ("drop_rate", "drop_rate"),
            )
        }
        if any(f.values()):
            faults[op] = f
    try:
        cfg = SimGymConfig(
            gym_id=args.gym_id,
            seed=args.seed,
            max_live=args.max_live,
            idle_ttl_s=args.idle_ttl,
            screenshot_retention_s=args.screenshot_retention,
            width=args.width,
            height=args.height,
            faults=faults,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server = GymServer(cfg, host=args.host, port=args.port, log_level=args.log_level)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return server.serve_until_interrupted(ready=f"ready {server.base_url}")
