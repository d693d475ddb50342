"""The agent's HTTP API (gbox-mini-agent's routes), the threaded server and the CLI."""

from __future__ import annotations

import argparse
import sys
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from cua_rl.agent.run import BadRunRequest, Run, parse_time
from cua_rl.serving import ThreadedServer
from cua_rl.sim.agent.service import AgentServerConfig, AgentService


def create_app(config: AgentServerConfig | None = None, client: httpx.AsyncClient | None = None):
    service = AgentService(config, client)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await service.aclose()

    app = FastAPI(title="cua-rl local gbox-mini-agent", lifespan=lifespan)
    app.state.service = service

    @app.post("/runs")
    async def create_run(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "body must be JSON"}, status_code=400)
        try:
            run = service.start(body)
        except BadRunRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return {"runId": run.id}

    _add_run_reads(app, service)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "runs": len(service.runs), **service.memory()}

    return app


def _add_run_reads(app: FastAPI, service: AgentService) -> None:
    """The GET routes of one run: status, events, steps, trajectory, tokens."""

    def _get(run_id: str) -> Run:
        run = service.runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"unknown run {run_id}")
        return run

    @app.get("/runs/{run_id}")
    async def get_run(run_id: str):
        run = _get(run_id)
        return {"runId": run.id, "status": run.status, "reason": run.reason}

    @app.get("/runs/{run_id}/events")
    async def get_events(run_id: str, request: Request):
        run = _get(run_id)
        q = request.query_params
        try:
            from_ms = parse_time(q["from"]) if q.get("from") else None
            to_ms = parse_time(q["to"]) if q.get("to") else None
        except BadRunRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        events = run.events_between(from_ms, to_ms)
        if not events and not run.events:
            raise HTTPException(404, "no events yet")
        return {"events": events}

    @app.get("/runs/{run_id}/steps")
    async def get_steps(run_id: str):
        steps = _get(run_id).steps
        if not steps:
            raise HTTPException(404, "no steps yet")
        return steps

    @app.get("/runs/{run_id}/steps/{index}")
    async def get_step(run_id: str, index: int):
        steps = _get(run_id).steps
        if not 0 <= index < len(steps):
            raise HTTPException(404, f"no step {index}")
        return steps[index]

    @app.get("/runs/{run_id}/trajectory")
    async def get_trajectory(run_id: str):
        run = _get(run_id)
        return {
            "runId": run.id,
            "task": run.body["task"],
            "status": run.status,
            "reason": run.reason,
            "steps": run.steps,
        }

    @app.get("/runs/{run_id}/tokens")
    async def get_tokens(run_id: str):
        run = _get(run_id)
        return {"runId": run.id, "steps": run.tokens}


class AgentServer(ThreadedServer):
    """The local agent on a free loopback port in a background thread: ``with AgentServer() as a``.

    ``a.url`` is the base URL to give ``MiniAgentClient``; ``a.service`` exposes the runs.
    """

    def __init__(
        self,
        config: AgentServerConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ):
        self.app = create_app(config)
        self.service: AgentService = self.app.state.service
        super().__init__(self.app, host=host, port=port, name="sim-agent", log_level=log_level)

    def start(self, timeout: float = 20.0) -> AgentServer:
        super().start(timeout)
        return self


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cua_rl.sim agent", description="local gbox-mini-agent over the sim gym"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument(
        "--image-mode", choices=("data", "url"), default="data",
        help="default screenshot transport to the model (per run: model.imageMode)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32, help="default max_tokens per call")
    parser.add_argument(
        "--step-latency", type=float, default=0.0, help="seconds each step waits after its action"
    )
    parser.add_argument(
        "--context", choices=("full", "mai-ui", "current"), default="full",
        help="default context policy (per run: model.context); docs/agent.md",
    )  # fmt: skip
    parser.add_argument(
        "--history-n", type=int, default=3,
        help="default screenshots per request of the mai-ui context (per run: model.historyN)",
    )  # fmt: skip
    parser.add_argument(
        "--spill-dir", default="",
        help="where finished runs' records are kept on disk (default: the temp dir)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    from cua_rl.errors import ConfigError

    try:
        config = AgentServerConfig(
            image_mode=args.image_mode,
            max_tokens=args.max_tokens,
            step_latency_s=args.step_latency,
            context=args.context,
            history_n=args.history_n,
            spill_dir=args.spill_dir,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = AgentServer(config, host=args.host, port=args.port, log_level=args.log_level)
    return server.serve_until_interrupted(ready=f"ready {server.url}")
