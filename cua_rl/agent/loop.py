"""The agent loop: screenshot, messages, model call(s), one action on the gym, events; per flavour.

One implementation, run by the local agent service (``cua_rl.sim.agent``: a run per ``POST
/runs``, followed over HTTP) and by the rollout workflow itself (``agent.mode: builtin``,
``cua_rl.agent.builtin``: no agent process). A step takes the screenshot from the gym's box
API (``POST .../executions/{id}/screenshot``), builds the request with the run's flavour and
context policy (``cua_rl.agent.flavours``, ``cua_rl.agent.context``), sends it to the run's OpenAI
endpoint (the episode's URL on the rollout gateway, which captures the exact tokens), parses one
action and executes it on the gym (``.../actions``). The run's events are gbox-mini-agent's, so
whoever reads them (the workflow's row builder, the monitor) cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from cua_rl.agent.actions import (
    LENIENT_GRID,
    ActionParseError,
    action_regex,
    to_event_args,
    to_gym_action,
)
from cua_rl.agent.context import (
    DEFAULT_HISTORY_N,
    ContextPolicy,
    Screen,
    StepRecord,
    build_messages,
)
from cua_rl.agent.flavours import Flavour, get_flavour
from cua_rl.agent.run import EndRun, Run, iso
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

IMAGE_CALL_ID = "__step_message_image__"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# What the local agent answers a model that asks the user (nobody is there to answer).
USER_REPLY = "No further information is available; continue with the task as given."
IMAGE_MODES = ("data", "url")


@dataclass
class LoopConfig:
    """How the agent loop talks to the gym and the model (the run body says the rest)."""

    image_mode: str = doc(
        "data", "how screenshots reach the model: 'data' (data URL) or 'url' (gym URL)"
    )
    max_tokens: int = doc(32, "max_tokens per model call of runs whose model object names none")
    step_latency_s: float = doc(
        0.0,
        (
            "seconds each step waits after its action, like a real device settling "
            "(benchmarks and demos of asynchronous training use it)"
        ),
    )
    http_timeout_s: float = doc(60.0, "timeout of each gym HTTP call (and model connect)")

    def __post_init__(self) -> None:
        if self.image_mode not in IMAGE_MODES:
            raise ConfigError(f"image_mode must be 'data' or 'url', got {self.image_mode!r}")
        if self.step_latency_s < 0:
            raise ConfigError(f"step_latency_s must be >= 0, got {self.step_latency_s}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.http_timeout_s <= 0:
            raise ConfigError(f"http_timeout_s must be > 0, got {self.http_timeout_s}")


@dataclass
class _RunContext:
    """What one run's steps share: where to act, how to prompt, what happened so far."""

    gym: str
    model: dict
    flavour: Flavour
    policy: ContextPolicy
    device: str
    history: list[StepRecord] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)  # image sent -> the gym's URL


def _record_messages(record: dict, messages: list[dict], policy, step: int, urls: dict) -> None:
    """The step's ``messages`` as gbox-mini-agent steps hold them, with the gym's screenshot
    URLs: with ``full`` what the step added to the conversation, otherwise the whole request
    (it is rebuilt every step)."""
    new = messages if policy.name != "full" or step == 1 else messages[-1:]
    for m in new:
        if not isinstance(m["content"], list):
            record["messages"].append(dict(m))
            continue
        parts = [
            {"type": "image_url", "image_url": {"url": urls.get(url, url)}}
            if p.get("type") == "image_url" and (url := p["image_url"]["url"])
            else p
            for p in m["content"]
        ]
        record["messages"].append({"role": m["role"], "callId": IMAGE_CALL_ID, "content": parts})


class AgentLoop:
    """Runs agent runs; one instance serves many concurrent runs (one HTTP client, one
    vocabulary cache). ``context`` / ``history_n``: the policy of runs whose model object
    names none."""

    def __init__(
        self,
        config: LoopConfig | None = None,
        client: httpx.AsyncClient | None = None,
        *,
        context: str = "full",
        history_n: int = DEFAULT_HISTORY_N,
    ):
        self.config = config or LoopConfig()
        self.context, self.history_n = context, history_n
        self._client = client
        self._own_client = client is None
        self._vocab_cache: dict[tuple[str, str], tuple[list[int], dict[str, int]]] = {}
        self._vocab_lock = asyncio.Lock()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # Each run holds at most one connection at a time; the model side bounds its own.
            self._client = httpx.AsyncClient(
                timeout=self.config.http_timeout_s,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=50),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None

    async def run(self, run: Run) -> None:
        """Run one agent run to its end; its status, reason and events are on ``run``."""
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
        except EndRun as end:
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
        base = env["gymBaseUrl"].rstrip("/")
        ctx = _RunContext(
            gym=f"{base}/api/v1/{env['gymId']}/executions/{env['executionId']}",
            model=model,
            flavour=get_flavour(model.get("flavour", "sim")),
            policy=ContextPolicy(
                model.get("context", self.context),
                model.get("historyN", self.history_n),
            ),
            device=body.get("standardActionSpace", "mobile"),
        )
        prev_step: dict | None = None
        step_limit = body.get("maxStepTimeSec")
        for step in range(1, body["maxSteps"] + 1):
            run.emit("step_start", step)
            record = {"index": step - 1, "step": step, "messages": [], "actions": []}
            run.steps.append(record)
            try:
                async with asyncio.timeout(step_limit):
                    finished = await self._step(run, step, ctx, record, prev_step)
            except TimeoutError as exc:
                # Only this step's own timeout arrives here: when maxRunTimeSec fires, the
                # cancellation passes through this context and the run's timeout converts it.
                raise EndRun(
                    "step_timeout", f"step {step} exceeded maxStepTimeSec={step_limit}"
                ) from exc
            run.emit("step_end", step)
            prev_step = record
            if finished:
                run.reason = "finished"
                return step
        return body["maxSteps"]

    async def _step(self, run, step, ctx: _RunContext, record, prev_step) -> bool:
        """One step: screenshot, model call(s), one action; whether the run is finished."""
        shot, screen = await self._observe(step, ctx, prev_step)
        messages = build_messages(
            run.body["task"],
            ctx.history,
            screen,
            ctx.flavour,
            ctx.policy,
            device=ctx.device,
            tools=ctx.model.get("tools"),
        )
        ctx.urls[screen.image_url] = shot["url"]
        _record_messages(record, messages, ctx.policy, step, ctx.urls)
        text, action, error = await self._ask_model(run, step, ctx, messages, record, shot)
        ctx.history.append(StepRecord(screen, text, action))
        return await self._act(run, step, ctx.gym, record, shot, action, error, text)

    async def _observe(self, step, ctx: _RunContext, prev_step) -> tuple[dict, Screen]:
        """Take the screenshot (the previous step's "after")."""
        shot = await self._gym_post(f"{ctx.gym}/screenshot", None)
        if prev_step is not None:
            for act in prev_step["actions"]:
                act["obs"]["screenshots"][0]["screenshot_after"] = shot.get("url")
        mode = ctx.model.get("imageMode", self.config.image_mode)
        image_url = shot["data_url"] if mode == "data" else shot["url"]
        return shot, Screen(step, image_url, shot["width"], shot["height"])

    async def _ask_model(self, run, step, ctx: _RunContext, messages, record, shot):
        """(reply text, parsed action or None, parse error or None). The request is built once:
        a reply that does not parse is asked again with the identical body (policy max_asks)."""
        request = await self._build_request(ctx.model, messages, shot)
        lenient = ctx.model.get("parse") == "lenient"
        grid = ctx.model.get("lenientGrid", LENIENT_GRID)
        for _ask in range(ctx.policy.max_asks):
            text = await self._call(run, step, ctx.model, request)
            try:
                action = ctx.flavour.read_reply(
                    text, shot["width"], shot["height"], lenient=lenient, grid=grid
                )
            except ActionParseError as exc:
                action, error = None, exc
            else:
                error = None
                break
        record["messages"].append({"role": "assistant", "content": text})
        record["text"] = text
        record["thinking"] = action.thought if action is not None else ""
        return text, action, error

    async def _call(self, run, step, model, request) -> str:
        """One model call; its tokens and logprobs go to ``run.tokens``."""
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
            raise EndRun("model_error", f"model answer has no choices[0].message: {exc}") from exc
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
        return text

    async def _act(self, run, step, gym, record, shot, action, error, text) -> bool:
        """Run the parsed action on the gym (a reply that did not parse is an ``invalid``
        action); whether the run is finished."""
        start_ms = int(time.time() * 1000)
        finished = False
        if action is None:
            event_action = {
                "name": "invalid",
                "args": {"text": text, "error": str(error)},
                "callId": f"call-{step}-0",
                "rawFeedback": f"parse_error: {error}",
                "rawResult": {"ok": False, "error": f"parse_error: {error}"},
            }
        else:
            finished, result = await self._execute(gym, action)
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
            startTs=iso(start_ms),
            endTs=iso(end_ms),
            durationMs=end_ms - start_ms,
        )
        return finished

    async def _execute(self, gym: str, action) -> tuple[bool, dict]:
        """(whether the run is finished, the action's result). Asking the user and MCP calls
        never reach the gym: nobody answers here, and the local agent has no MCP server."""
        if action.name == "ask_user":
            return False, {"ok": True, "error": None, "reply": USER_REPLY}
        if action.name == "mcp_call":
            tool = action.params.get("tool")
            return False, {"ok": False, "error": f"no MCP server provides {tool!r} here"}
        gym_action = to_gym_action(action)
        if gym_action is None:
            return True, {"ok": True, "error": None}
        return False, await self._gym_post(f"{gym}/actions", gym_action, refusals=True)

    # ---- services ---------------------------------------------------------------------------

    async def _gym_post(self, url: str, body: dict | None, *, refusals: bool = False) -> dict:
        """POST to the gym; with ``refusals`` a 400 (a well-formed call the gym refuses, e.g. an
        off-screen tap: the agent's mistake) comes back as a failed result instead of ending
        the run."""
        try:
            resp = await self.client.post(url, json=body, timeout=self.config.http_timeout_s)
        except httpx.HTTPError as exc:
            raise EndRun("env_error", f"gym {url}: {type(exc).__name__}: {exc}") from exc
        if refusals and resp.status_code == 400:
            return {"ok": False, "error": resp.text[:300], "status": 400}
        if resp.status_code != 200:
            raise EndRun("env_error", f"gym {url} answered {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise EndRun("env_error", f"gym {url} answered non-JSON") from exc

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
            # No read limit of its own: the gateway holds a call through a weight update or a
            # model-server outage (each bounded by its setting), and maxStepTimeSec bounds it.
            timeout = httpx.Timeout(self.config.http_timeout_s, read=None)
            resp = await self.client.post(url, json=request, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EndRun("model_error", f"model {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EndRun(
                "model_error", f"model {url} answered {resp.status_code}: {resp.text[:300]}"
            )
        try:
            return resp.json()
        except ValueError as exc:
            raise EndRun("model_error", f"model {url} answered non-JSON") from exc

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
                raise EndRun("model_error", f"tokenize {text!r} failed: {exc}") from exc

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
            raise EndRun(
                "model_error",
                f"constrain needs single-token ASCII characters and {END_TOKENS[0]} in the vocabulary",
            )
        return sorted(ascii_ids), ends
