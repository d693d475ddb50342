"""A local gbox-mini-agent: the same HTTP API and event format (docs/design.md), run against the sim gym.

Each ``POST /runs`` starts an asyncio task on the server's loop; every run shares one
``httpx.AsyncClient``, so parallel runs only meet in the gym and the model server. A step is:
capture a screenshot on the gym, append a user message with it (data URL, or the gym's HTTP URL
with ``imageMode: "url"``) to the run's message list, send the whole list (append-only: earlier
assistant outputs go back verbatim) to ``model.baseUrl`` with ``logprobs`` and
``return_token_ids``, parse one action (``cua_rl.sim.actions``), execute it on the gym, and
record events. Timestamps are strictly increasing per run, so ``(type, ts, step, actionIndex)``
identifies every event.

Reasons in ``run_end`` / ``GET /runs/{id}``: ``finished`` and ``max_steps`` (status
``completed``); ``timeout`` (maxRunTimeSec), ``step_timeout`` (maxStepTimeSec), ``model_error``,
``env_error`` and ``internal_error`` (status ``failed``). A model output with no valid action is
reported as an ``action_executed`` whose action is named ``invalid`` (nothing is executed) and the
run goes on; ``error`` events are kept for failures of the services around the agent.

Model options beyond ``baseUrl`` / ``name`` / ``provider`` (all optional): ``logprobs`` (default
true), ``topLogprobs``, ``temperature`` (1.0), ``maxTokens`` (32), ``seed``, ``imageMode``
(``data`` | ``url``), ``constrain`` (``regex``: vLLM structured outputs limited to the action
language; ``ascii``: ``allowed_token_ids`` = printable ASCII + end tokens) and ``actions`` (action
names the regex allows, e.g. without ``finished``) and ``parse`` (``strict``, or ``lenient``: a
reply with no valid call taps the grid cell its first character names, see
``cua_rl.sim.actions``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from cua_rl.serving import ThreadedServer
from cua_rl.sim.actions import (
    ACTION_NAMES,
    SYSTEM_PROMPT,
    ActionParseError,
    action_regex,
    read_reply,
    to_event_args,
    to_gym_action,
)

IMAGE_CALL_ID = "__step_message_image__"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


@dataclass
class AgentServerConfig:
    """Settings of the local agent service."""

    image_mode: str = field(
        default="data",
        metadata={"help": "how screenshots reach the model: 'data' (data URL) or 'url' (gym URL)"},
    )
    max_tokens: int = field(default=32, metadata={"help": "default max_tokens per model call"})
    step_latency_s: float = field(
        default=0.0,
        metadata={
            "help": "seconds each step waits after its action, like a real device settling "
            "(benchmarks and demos of asynchronous training use it)"
        },
    )
    http_timeout_s: float = field(
        default=60.0, metadata={"help": "timeout of each gym / model HTTP call"}
    )
    max_runs_kept: int = field(
        default=512, metadata={"help": "finished runs kept for GET before the oldest are dropped"}
    )

    def __post_init__(self) -> None:
        from cua_rl.errors import ConfigError

        if self.image_mode not in ("data", "url"):
            raise ConfigError(f"image_mode must be 'data' or 'url', got {self.image_mode!r}")
        if self.step_latency_s < 0:
            raise ConfigError(f"step_latency_s must be >= 0, got {self.step_latency_s}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.http_timeout_s <= 0:
            raise ConfigError(f"http_timeout_s must be > 0, got {self.http_timeout_s}")
        if self.max_runs_kept < 1:
            raise ConfigError(f"max_runs_kept must be >= 1, got {self.max_runs_kept}")


class BadRunRequest(ValueError):
    """A POST /runs body the agent cannot run; answered with 400 and this message."""


class _EndRun(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.") + (
        f"{ms % 1000:03d}Z"
    )


def parse_time(value: str) -> int:
    """An events ``from`` / ``to`` bound (epoch ms or ISO 8601) as epoch ms."""
    value = value.strip()
    try:
        return int(float(value))
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise BadRunRequest(f"time bound {value!r} is neither epoch ms nor ISO 8601") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(round(dt.timestamp() * 1000))


def validate_run_body(body: Any) -> dict:
    """Checks a POST /runs body; raises BadRunRequest naming the field to fix."""
    if not isinstance(body, dict):
        raise BadRunRequest("body must be a JSON object")
    if not isinstance(body.get("task"), str) or not body["task"].strip():
        raise BadRunRequest("task must be a non-empty string")
    max_steps = body.get("maxSteps")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise BadRunRequest(f"maxSteps must be an integer >= 1, got {max_steps!r}")
    for name in ("maxRunTimeSec", "maxStepTimeSec"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise BadRunRequest(f"{name} must be a positive number, got {value!r}")
    model = body.get("model")
    if not isinstance(model, dict) or not model.get("baseUrl") or not model.get("name"):
        raise BadRunRequest("model must be {baseUrl, name, provider}")
    if model.get("provider", "openai") != "openai":
        raise BadRunRequest(f"only provider 'openai' is supported, got {model.get('provider')!r}")
    if model.get("imageMode", "data") not in ("data", "url"):
        raise BadRunRequest("model.imageMode must be 'data' or 'url'")
    if model.get("constrain") not in (None, False, "regex", "ascii"):
        raise BadRunRequest("model.constrain must be 'regex', 'ascii' or absent")
    if model.get("parse", "strict") not in ("strict", "lenient"):
        raise BadRunRequest("model.parse must be 'strict' or 'lenient'")
    actions = model.get("actions")
    if actions is not None and (
        not isinstance(actions, list) or not actions or any(a not in ACTION_NAMES for a in actions)
    ):
        raise BadRunRequest(f"model.actions must be a non-empty subset of {list(ACTION_NAMES)}")
    env = body.get("env")
    if not isinstance(env, dict) or env.get("type") != "genv":
        raise BadRunRequest("env must be {type: 'genv', gymBaseUrl, gymId, executionId}")
    for key in ("gymBaseUrl", "gymId", "executionId"):
        if not env.get(key):
            raise BadRunRequest(f"env.{key} is required")
    if body.get("standardActionSpace", "mobile") not in ("mobile", "pc"):
        raise BadRunRequest("standardActionSpace must be 'mobile' or 'pc'")
    return body


class Run:
    """State of one run; events are appended only by the run's own task."""

    def __init__(self, run_id: str, body: dict):
        self.id = run_id
        self.body = body
        self.status = "queued"
        self.reason: str | None = None
        self.events: list[dict] = []
        self._event_ms: list[int] = []
        self.steps: list[dict] = []
        self.tokens: list[dict] = []
        self.created_at = time.time()
        self.task: asyncio.Task | None = None
        self._last_ms = 0

    def emit(self, type_: str, step: int, **fields) -> dict:
        # Strictly increasing ms timestamps keep (type, ts, step, actionIndex) unique.
        ms = max(int(time.time() * 1000), self._last_ms + 1)
        self._last_ms = ms
        event = {"type": type_, "ts": _iso(ms), "step": step, **fields}
        self.events.append(event)
        self._event_ms.append(ms)
        return event

    def events_between(self, from_ms: int | None, to_ms: int | None) -> list[dict]:
        return [
            ev
            for ev, ms in zip(self.events, self._event_ms, strict=True)
            if (from_ms is None or ms >= from_ms) and (to_ms is None or ms < to_ms)
        ]


class AgentService:
    """Runs agent loops; one instance per server."""

    def __init__(
        self, config: AgentServerConfig | None = None, client: httpx.AsyncClient | None = None
    ):
        self.config = config or AgentServerConfig()
        self._client = client
        self._own_client = client is None
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self._ids = itertools.count(1)
        self._vocab_cache: dict[tuple[str, str], tuple[list[int], dict[str, int]]] = {}
        self._vocab_lock = asyncio.Lock()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self.config.http_timeout_s,
                limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
            )
        return self._client

    async def aclose(self) -> None:
        for run in list(self.runs.values()):
            if run.task and not run.task.done():
                run.task.cancel()
        if self._client is not None and self._own_client:
            await self._client.aclose()

    def start(self, body: dict) -> Run:
        validate_run_body(body)
        run_id = f"run-{int(time.time())}-{next(self._ids)}"
        run = Run(run_id, body)
        self.runs[run_id] = run
        self._forget_old()
        run.task = asyncio.create_task(self._run(run), name=run_id)
        return run

    def _forget_old(self) -> None:
        while len(self.runs) > self.config.max_runs_kept:
            oldest_id = next(
                (rid for rid, r in self.runs.items() if r.task is None or r.task.done()), None
            )
            if oldest_id is None:
                return
            del self.runs[oldest_id]

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self, run: Run) -> None:
        body = run.body
        run.status = "running"
        step = 0
        try:
            limit = body.get("maxRunTimeSec")
            async with asyncio.timeout(limit):
                step = await self._loop(run)
            run.reason = "finished" if run.reason == "finished" else "max_steps"
            run.status = "completed"
        except TimeoutError:
            step = max(step, len(run.steps))
            run.status, run.reason = "failed", "timeout"
            run.emit("error", max(step, 1), message=f"run exceeded maxRunTimeSec={limit}")
        except _EndRun as end:
            step = max(step, len(run.steps))
            run.status, run.reason = "failed", end.reason
            run.emit("error", max(step, 1), message=end.message)
        except asyncio.CancelledError:
            run.status, run.reason = "failed", "cancelled"
            raise
        except Exception as exc:  # a bug must still end the run visibly
            step = max(step, len(run.steps))
            run.status, run.reason = "failed", "internal_error"
            run.emit("error", max(step, 1), message=f"{type(exc).__name__}: {exc}")
        run.emit(
            "run_end", max(step, len(run.steps), 1), ok=run.reason == "finished", reason=run.reason
        )

    async def _loop(self, run: Run) -> int:
        body = run.body
        model = body["model"]
        env = body["env"]
        gym = (
            f"{env['gymBaseUrl'].rstrip('/')}/api/v1/{env['gymId']}/executions/{env['executionId']}"
        )
        messages: list[dict] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Task: {body['task']}"},
        ]
        prev_step: dict | None = None
        step_limit = body.get("maxStepTimeSec")
        for step in range(1, body["maxSteps"] + 1):
            run.emit("step_start", step)
            record = {"index": step - 1, "step": step, "messages": [], "actions": []}
            if step == 1:
                record["messages"].extend(messages)
            run.steps.append(record)
            try:
                async with asyncio.timeout(step_limit):
                    finished = await self._step(run, step, gym, model, messages, record, prev_step)
            except TimeoutError as exc:
                # Only this step's own timeout arrives here: when maxRunTimeSec fires, the
                # cancellation passes through this context and the run's timeout converts it.
                raise _EndRun(
                    "step_timeout", f"step {step} exceeded maxStepTimeSec={step_limit}"
                ) from exc
            run.emit("step_end", step)
            prev_step = record
            if finished:
                run.reason = "finished"
                return step
        return body["maxSteps"]

    async def _step(self, run, step, gym, model, messages, record, prev_step) -> bool:
        shot = await self._gym_post(f"{gym}/screenshot", None)
        if prev_step is not None:
            for act in prev_step["actions"]:
                act["obs"]["screenshots"][0]["screenshot_after"] = shot.get("url")
        mode = model.get("imageMode", self.config.image_mode)
        image_url = shot["data_url"] if mode == "data" else shot["url"]
        user_msg = {
            "role": "user",
            "content": [
                {"type": "text", "text": f"Step {step}. Screen {shot['width']}x{shot['height']}."},
                {"type": "image_url", "image_url": {"url": image_url}},
            ],
        }
        messages.append(user_msg)
        record["messages"].append(
            {
                "role": "user",
                "callId": IMAGE_CALL_ID,
                "content": [
                    user_msg["content"][0],
                    {"type": "image_url", "image_url": {"url": shot["url"]}},
                ],
            }
        )
        request = await self._build_request(model, messages, shot)
        run.emit("model_call", step, modelSpecificInput=request)
        t0 = time.time()
        output = await self._model_call(model, request)
        run.emit(
            "model_output", step, modelOutput=output, durationMs=int((time.time() - t0) * 1000)
        )
        try:
            choice = output["choices"][0]
            text = choice["message"].get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise _EndRun("model_error", f"model answer has no choices[0].message: {exc}") from exc
        run.tokens.append(
            {
                "step": step,
                "prompt_token_ids": output.get("prompt_token_ids"),
                "token_ids": choice.get("token_ids"),
                "logprobs": [
                    c.get("logprob") for c in ((choice.get("logprobs") or {}).get("content") or [])
                ],
            }
        )
        messages.append({"role": "assistant", "content": text})
        record["messages"].append({"role": "assistant", "content": text})
        record["text"] = text
        record["thinking"] = ""

        start_ms = int(time.time() * 1000)
        finished = False
        try:
            action = read_reply(
                text, shot["width"], shot["height"], lenient=model.get("parse") == "lenient"
            )
        except ActionParseError as exc:
            event_action = {
                "name": "invalid",
                "args": {"text": text, "error": str(exc)},
                "callId": f"call-{step}-0",
                "rawFeedback": f"parse_error: {exc}",
                "rawResult": {"ok": False, "error": f"parse_error: {exc}"},
            }
        else:
            gym_action = to_gym_action(action)
            if gym_action is None:
                finished = True
                result = {"ok": True, "error": None}
            else:
                result = await self._gym_action(f"{gym}/actions", gym_action)
            event_action = {
                "name": action.name,
                "args": to_event_args(action),
                "callId": f"call-{step}-0",
                "rawFeedback": action.text,
                "rawResult": result,
            }
        end_ms = int(time.time() * 1000)
        record["actions"].append(
            {
                "action": event_action,
                "obs": {
                    "screenshots": [
                        {"screenshot_before": shot.get("url"), "screenshot_after": None}
                    ]
                },
            }
        )
        if self.config.step_latency_s:
            await asyncio.sleep(self.config.step_latency_s)
        run.emit(
            "action_executed",
            step,
            action=event_action,
            actionIndex=0,
            startTs=_iso(start_ms),
            endTs=_iso(end_ms),
            durationMs=end_ms - start_ms,
        )
        return finished

    # ---- services ---------------------------------------------------------------------------

    async def _gym_post(self, url: str, body: dict | None) -> dict:
        try:
            resp = await self.client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise _EndRun("env_error", f"gym {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise _EndRun("env_error", f"gym {url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise _EndRun("env_error", f"gym {url} answered non-JSON") from exc

    async def _gym_action(self, url: str, body: dict) -> dict:
        try:
            resp = await self.client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise _EndRun("env_error", f"gym {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code == 400:
            # A well-formed call the gym refuses (e.g. off-screen tap): the agent's mistake.
            return {"ok": False, "error": resp.text[:300], "status": 400}
        if resp.status_code != 200:
            raise _EndRun("env_error", f"gym {url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise _EndRun("env_error", f"gym {url} answered non-JSON") from exc

    async def _build_request(self, model: dict, messages: list[dict], shot: dict) -> dict:
        request: dict[str, Any] = {
            "model": model["name"],
            # A copy: later steps append to `messages`, the event must show what was sent.
            "messages": [dict(m) for m in messages],
            "max_tokens": int(model.get("maxTokens", self.config.max_tokens)),
            "temperature": float(model.get("temperature", 1.0)),
        }
        if model.get("seed") is not None:
            request["seed"] = int(model["seed"])
        if model.get("logprobs", True):
            request["logprobs"] = True
            request["return_token_ids"] = True
            if model.get("topLogprobs"):
                request["top_logprobs"] = int(model["topLogprobs"])
        constrain = model.get("constrain")
        if constrain:
            # Both modes end a turn only with <|im_end|>: the chat template closes an assistant
            # message with it, so any other stop token (e.g. <|endoftext|>) would make the next
            # prompt differ from this prompt + output and break the multi-turn prefix.
            ascii_ids, ends = await self._vocab(model)
            im_end = ends[END_TOKENS[0]]
            if constrain == "regex":
                request["structured_outputs"] = {
                    "regex": action_regex(model.get("actions"), shot["width"], shot["height"])
                }
                others = [i for t, i in ends.items() if i != im_end]
                if others:
                    request["logit_bias"] = {str(i): -100 for i in others}
            else:
                request["allowed_token_ids"] = sorted({*ascii_ids, im_end})
        return request

    async def _model_call(self, model: dict, request: dict) -> dict:
        url = f"{model['baseUrl'].rstrip('/')}/chat/completions"
        try:
            resp = await self.client.post(url, json=request)
        except httpx.HTTPError as exc:
            raise _EndRun("model_error", f"model {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise _EndRun(
                "model_error", f"model {url} answered {resp.status_code}: {resp.text[:300]}"
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise _EndRun("model_error", f"model {url} answered non-JSON") from exc

    async def _vocab(self, model: dict) -> tuple[list[int], dict[str, int]]:
        """(ids of single printable ASCII characters, ids of the end tokens), via vLLM /tokenize."""
        key = (model["baseUrl"], model["name"])
        if key in self._vocab_cache:
            return self._vocab_cache[key]
        # Parallel first runs would each make ~100 /tokenize calls: one lookup per model.
        async with self._vocab_lock:
            if key not in self._vocab_cache:
                self._vocab_cache[key] = await self._lookup_vocab(model)
        return self._vocab_cache[key]

    async def _lookup_vocab(self, model: dict) -> tuple[list[int], dict[str, int]]:
        base = model["baseUrl"].rstrip("/")
        root = base[: -len("/v1")] if base.endswith("/v1") else base

        async def ids_of(text: str) -> list[int]:
            try:
                resp = await self.client.post(
                    f"{root}/tokenize",
                    json={"model": model["name"], "prompt": text, "add_special_tokens": False},
                )
                resp.raise_for_status()
                return [int(t) for t in resp.json().get("tokens") or []]
            except (httpx.HTTPError, ValueError, TypeError) as exc:
                raise _EndRun("model_error", f"tokenize {text!r} failed: {exc}") from exc

        ascii_ids: set[int] = set()
        for c in range(32, 127):
            tokens = await ids_of(chr(c))
            if len(tokens) == 1:
                ascii_ids.add(tokens[0])
        ends = {}
        for text in END_TOKENS:
            tokens = await ids_of(text)
            if len(tokens) == 1:
                ends[text] = tokens[0]
        if not ascii_ids or END_TOKENS[0] not in ends:
            raise _EndRun(
                "model_error",
                f"constrain needs single-token ASCII characters and {END_TOKENS[0]} in the vocabulary",
            )
        return sorted(ascii_ids), ends


# ---- HTTP API ---------------------------------------------------------------------------------


def create_app(config: AgentServerConfig | None = None, client: httpx.AsyncClient | None = None):
    service = AgentService(config, client)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await service.aclose()

    app = FastAPI(title="cua-rl local gbox-mini-agent", lifespan=lifespan)
    app.state.service = service

    def _get(run_id: str) -> Run:
        run = service.runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"unknown run {run_id}")
        return run

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
        if not run.events:
            raise HTTPException(404, "no events yet")
        return {"events": events}

    @app.get("/runs/{run_id}/steps")
    async def get_steps(run_id: str):
        run = _get(run_id)
        if not run.steps:
            raise HTTPException(404, "no steps yet")
        return run.steps

    @app.get("/runs/{run_id}/steps/{index}")
    async def get_step(run_id: str, index: int):
        run = _get(run_id)
        if not 0 <= index < len(run.steps):
            raise HTTPException(404, f"no step {index}")
        return run.steps[index]

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

    @app.get("/healthz")
    async def healthz():
        return {"ok": True, "runs": len(service.runs)}

    return app


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
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    from cua_rl.errors import ConfigError

    try:
        config = AgentServerConfig(
            image_mode=args.image_mode,
            max_tokens=args.max_tokens,
            step_latency_s=args.step_latency,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = AgentServer(config, host=args.host, port=args.port, log_level=args.log_level)
    return server.serve_until_interrupted(ready=f"ready {server.url}")
