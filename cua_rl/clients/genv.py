"""Client for the gym server ("genv"): one async method per endpoint, and a safe execution scope.

Wire format: docs/design.md, the gym server. Base URL ``{base_url}/api/v1/{gym_id}``.

Leak safety is the point of this module, because the real server leaks boxes when terminate is
skipped and has no status endpoint to find an execution later:

- ``create_execution`` is never retried after an ambiguous outcome (only a 429, where the
  gym refused and created nothing, is retried with backoff). When the caller's deadline (``create_s``) passes or the
  caller is cancelled, the request itself is *not* abandoned: it keeps waiting in the background
  for up to ``create_grace_s`` more seconds, and if the server then reveals an execution id, that
  execution is terminated. The caller gets ``GymError`` (or its cancellation) at once and rejects
  the episode. A create whose connection is dropped never reveals its id; only the server's own
  idle expiry can reclaim such an execution, which is why a retry would be wrong (it would make
  a second one).
- ``terminate`` is retried (transport errors, 5xx, 429) and idempotent: a 404 after an earlier
  attempt failed in transit counts as done, while a 404 on the first attempt is an error (it
  usually means a wrong gym id or base URL, which would otherwise leak silently).
- ``execution()`` terminates on every exit (normal, exception, cancellation, timeout), shielded
  from cancellation and bounded by ``terminate_budget_s``.

The answers' many shapes are parsed in ``genv_answers`` (``EvaluationResult``: score, success,
validators); turning one into a reward is reward.py's job.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import httpx

from cua_rl.aio import within
from cua_rl.clients.genv_answers import (
    CreatedExecution,
    EvaluationResult,
    parse_created,
    parse_evaluation,
)
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError, GymError
from cua_rl.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")


@dataclass
class GenvTimeouts:
    connect_s: float = doc(10.0, "TCP connect timeout for every call")
    request_s: float = doc(60.0, "list / get task calls, per attempt")
    create_s: float = doc(600.0, "how long a create may take (a box may take minutes to boot)")
    create_refused_attempts: int = doc(
        3, "create attempts while the gym answers 429 (a definite refusal: nothing was created)"
    )
    create_grace_s: float = doc(
        300.0,
        "after create_s, keep listening this long for a late answer so that execution is terminated",
    )
    evaluate_s: float = doc(300.0, "evaluate call, per attempt")
    terminate_s: float = doc(30.0, "terminate call, per attempt")
    terminate_attempts: int = doc(4, "terminate attempts before giving up (it is idempotent)")
    terminate_budget_s: float = doc(90.0, "bound on terminating one execution, retries included")
    read_attempts: int = doc(3, "attempts for list / get task (idempotent reads)")
    evaluate_attempts: int = doc(2, "attempts for evaluate (it reads the execution's state)")
    backoff_s: float = doc(0.5, "first retry delay; doubles per attempt")

    def __post_init__(self) -> None:
        for name in (
            "connect_s",
            "request_s",
            "create_s",
            "evaluate_s",
            "terminate_s",
            "terminate_budget_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"GenvTimeouts.{name}={getattr(self, name)!r} must be > 0 seconds"
                )
        if self.create_grace_s < 0 or self.backoff_s < 0:
            raise ConfigError("GenvTimeouts.create_grace_s and backoff_s must be >= 0 seconds")
        for name in (
            "terminate_attempts",
            "read_attempts",
            "evaluate_attempts",
            "create_refused_attempts",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"GenvTimeouts.{name}={getattr(self, name)!r} must be at least 1")


def _retryable(e: GymError) -> bool:
    return e.status is None or e.status >= 500 or e.status in (408, 429)


def _detail(r: httpx.Response) -> tuple[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return r.text[:300], r.text[:2000]
    if isinstance(body, dict):
        for k in ("detail", "error", "message"):
            if body.get(k):
                return str(body[k])[:300], body
    return str(body)[:300], body


class GenvClient:
    """Async client for one gym. Inject ``client`` to share a connection pool or to add faults."""

    def __init__(
        self,
        base_url: str,
        gym_id: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeouts: GenvTimeouts | None = None,
    ):
        if not base_url or not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"gym base_url={base_url!r} must be an http(s) URL such as http://127.0.0.1:8800"
            )
        if not gym_id or "/" in gym_id:
            raise ConfigError(
                f"gym_id={gym_id!r} is required (there is no safe default); set it to the gym's id, e.g. 'sim'"
            )
        if "/api/" in f"{urlsplit(base_url).path}/":
            raise ConfigError(
                f"gym base_url={base_url!r} has the API path in it: give the server root, e.g. "
                f"{base_url.split('/api/', 1)[0]} (the client adds /api/v1/{{gym_id}})"
            )
        self.root = base_url.rstrip("/")
        self.base = f"{self.root}/api/v1/{gym_id}"
        self.gym_id = gym_id
        self.timeouts = timeouts or GenvTimeouts()
        self._own = client is None
        self._client = client or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128)
        )
        self._background: set[asyncio.Task] = set()
        self.stats: Counter[str] = Counter()

    async def __aenter__(self) -> GenvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def background(self) -> set[asyncio.Task]:
        """The background terminates of late creates still running (a drain waits for them)."""
        return {t for t in self._background if not t.done()}

    async def aclose(self, timeout: float | None = None) -> None:
        """Wait (bounded) for background terminates of late creates, then close an owned client."""
        pending = list(self._background)
        if pending:
            bound = (
                timeout
                if timeout is not None
                else self.timeouts.create_grace_s + self.timeouts.terminate_budget_s
            )
            _done, still = await asyncio.wait(pending, timeout=bound)
            for t in still:
                t.cancel()
            if still:
                log.warning("gave up on %d background gym cleanups at close", len(still))
        if self._own:
            await self._client.aclose()

    # -- transport ------------------------------------------------------------------------
    async def _call(
        self, method: str, path: str, op: str, timeout: float, json: Any = None, strict: bool = True
    ) -> Any:
        t = httpx.Timeout(timeout, connect=min(self.timeouts.connect_s, timeout))
        try:
            async with asyncio.timeout(timeout):
                r = await self._client.request(method, self.base + path, json=json, timeout=t)
        except (TimeoutError, httpx.TimeoutException) as e:
            raise GymError(f"gym {op} timed out after {timeout:g}s") from e
        except httpx.ConnectError as e:
            raise GymError(
                f"gym {op}: nothing answers at {self.root} ({e}): start the gym, or fix the host "
                "and port of gym.base_url"
            ) from e
        except httpx.HTTPError as e:
            raise GymError(f"gym {op} failed in transport: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            detail, body = _detail(r)
            # A 404 on a gym's own path: the URL or the id is wrong, rarely the call itself.
            hint = (
                f" (is {self.root} the gym server's root and {self.gym_id!r} a gym it serves? "
                "check gym.base_url and gym.gym_id)"
                if r.status_code == 404
                else ""
            )
            raise GymError(
                f"gym {op} answered {r.status_code}: {detail}{hint}",
                status=r.status_code,
                body=body,
            )
        try:
            return r.json()
        except ValueError:
            if not strict:  # an answer the caller ignores anyway (terminate)
                return {"answer": r.text[:2000]}
            raise GymError(
                f"gym {op} answered {r.status_code} with non-JSON",
                status=r.status_code,
                body=r.text[:2000],
            ) from None

    async def _retry(self, fn: Callable[[], Awaitable[T]], attempts: int, op: str) -> T:
        delay = self.timeouts.backoff_s
        for attempt in range(1, attempts + 1):
            try:
                return await fn()
            except GymError as e:
                if attempt == attempts or not _retryable(e):
                    raise
                log.info("gym %s attempt %d/%d failed (%s); retrying", op, attempt, attempts, e)
                self.stats[f"{op}_retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- endpoints ------------------------------------------------------------------------
    async def list_tasks(self) -> list[dict]:
        """``GET /tasks``: the raw task entries (``{"tasks": [...]}`` or a bare list)."""
        data = await self._retry(
            lambda: self._call("GET", "/tasks", "list tasks", self.timeouts.request_s),
            self.timeouts.read_attempts,
            "list_tasks",
        )
        tasks = data.get("tasks") if isinstance(data, dict) else data
        if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
            raise GymError(
                "list tasks answered neither a list of task objects nor {'tasks': [...]}", body=data
            )
        return tasks

    async def get_task(self, task_id: str) -> dict:
        """``GET /tasks/{task_id}``: the full task object."""
        path = f"/tasks/{quote(task_id, safe='')}"
        data = await self._retry(
            lambda: self._call("GET", path, f"get task {task_id}", self.timeouts.request_s),
            self.timeouts.read_attempts,
            "get_task",
        )
        if not isinstance(data, dict):
            raise GymError(f"get task {task_id!r} answered a non-object", body=data)
        return data

    async def create_execution(self, task_id: str, options: dict | None = None) -> CreatedExecution:
        """``POST /tasks/{task_id}``. Only a 429 (the gym refused, nothing was created) is retried;
        timeouts, transport failures and 5xx never are (see the module docstring)."""
        delay = self.timeouts.backoff_s
        for attempt in range(1, self.timeouts.create_refused_attempts + 1):
            try:
                return await self._create_once(task_id, options)
            except GymError as e:
                if e.status != 429 or attempt == self.timeouts.create_refused_attempts:
                    raise
                self.stats["create_refused_retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _create_once(self, task_id: str, options: dict | None) -> CreatedExecution:
        t = self.timeouts
        path = f"/tasks/{quote(task_id, safe='')}"
        body = {"options": dict(options or {})}
        req = asyncio.ensure_future(
            self._call("POST", path, f"create {task_id}", t.create_s + t.create_grace_s, json=body)
        )
        try:
            data = await within(t.create_s, asyncio.shield(req))
        except (TimeoutError, asyncio.CancelledError) as e:
            self._adopt_late_create(req, task_id)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.stats["create_timeouts"] += 1
            raise GymError(
                f"gym create for task {task_id!r} timed out after {t.create_s:g}s; not retried (a late answer is terminated in the background)"
            ) from None
        return parse_created(data, task_id)

    def _adopt_late_create(self, req: asyncio.Future, task_id: str) -> None:
        async def reap() -> None:
            try:
                created = parse_created(await req, task_id)
            except Exception as e:  # the create failed for good: nothing was revealed to terminate
                log.info("abandoned create for %s ended without an execution id: %s", task_id, e)
                return
            self.stats["late_creates_terminated"] += 1
            log.warning(
                "terminating execution %s whose create answered after the caller gave up",
                created.execution_id,
            )
            try:
                await self.terminate(created.execution_id)
            except GymError as e:
                self.stats["terminate_failed"] += 1
                log.error("could not terminate late execution %s: %s", created.execution_id, e)

        self._track(asyncio.ensure_future(reap()))

    async def evaluate(
        self,
        execution_id: str,
        execution_data: Any = None,
        answer_text: str | None = None,
        context_text: str | None = None,
        facts: Any = None,
    ) -> EvaluationResult:
        """``POST /executions/{id}/evaluate``; only the fields given are sent."""
        body = {
            k: v
            for k, v in (
                ("execution_data", execution_data),
                ("answer_text", answer_text),
                ("context_text", context_text),
                ("facts", facts),
            )
            if v is not None
        }
        path = f"/executions/{quote(execution_id, safe='')}/evaluate"
        data = await self._retry(
            lambda: self._call(
                "POST", path, f"evaluate {execution_id}", self.timeouts.evaluate_s, json=body
            ),
            self.timeouts.evaluate_attempts,
            "evaluate",
        )
        return parse_evaluation(data)

    async def terminate(self, execution_id: str) -> dict:
        """``POST /executions/{id}/terminate``, retried and idempotent, bounded by ``terminate_budget_s``."""
        t = self.timeouts
        path = f"/executions/{quote(execution_id, safe='')}/terminate"
        delay = t.backoff_s
        try:
            async with asyncio.timeout(t.terminate_budget_s):
                for attempt in range(1, t.terminate_attempts + 1):
                    try:
                        data = await self._call(
                            "POST", path, f"terminate {execution_id}", t.terminate_s, strict=False
                        )
                        self.stats["terminated"] += 1
                        return data if isinstance(data, dict) else {"answer": data}
                    except GymError as e:
                        if e.status == 404 and attempt > 1:
                            # An earlier attempt most likely succeeded but its answer was lost.
                            self.stats["terminated"] += 1
                            return {"already_terminated": True, "status": 404}
                        if attempt == t.terminate_attempts or not _retryable(e):
                            raise
                        self.stats["terminate_retries"] += 1
                        log.info(
                            "terminate %s attempt %d failed (%s); retrying",
                            execution_id,
                            attempt,
                            e,
                        )
                    await asyncio.sleep(delay)
                    delay *= 2
        except TimeoutError:
            raise GymError(
                f"gym terminate {execution_id} did not succeed within {t.terminate_budget_s:g}s"
            ) from None
        raise AssertionError("unreachable")

    async def screenshot(self, execution_id: str) -> dict:
        """``POST /executions/{id}/screenshot``, a box route (docs/agent.md): ``{url, data_url,
        width, height}``. Not retried: an agent asks again if it wants to."""
        path = f"/executions/{quote(execution_id, safe='')}/screenshot"
        data = await self._call("POST", path, f"screenshot {execution_id}", self.timeouts.request_s)
        if not isinstance(data, dict) or not all(
            isinstance(data.get(k), int) for k in ("width", "height")
        ):
            raise GymError(
                f"screenshot {execution_id} answered no {{url, data_url, width, height}}",
                body=data,
            )
        return data

    async def act(self, execution_id: str, action: dict) -> dict:
        """``POST /executions/{id}/actions`` with the gym's ``{name, args}``, a box route: the
        gym's answer (``{ok, error}``). A refused action (400: an off-screen tap, an unknown
        key) is the agent's mistake, not the gym's failure: it comes back as ``{"ok": False,
        "error": <the gym's message>, "status": 400}``. Never retried (an action is not
        idempotent)."""
        path = f"/executions/{quote(execution_id, safe='')}/actions"
        op = f"action {action.get('name')!r} on {execution_id}"
        try:
            data = await self._call("POST", path, op, self.timeouts.request_s, json=action)
        except GymError as e:
            if e.status != 400:
                raise
            body = e.body if isinstance(e.body, dict) else {}
            error = next((str(body[k]) for k in ("detail", "error", "message") if body.get(k)), "")
            return {"ok": False, "error": (error or str(e))[:300], "status": 400}
        return data if isinstance(data, dict) else {"ok": True, "answer": data}

    # -- execution scope ------------------------------------------------------------------
    @asynccontextmanager
    async def execution(
        self, task_id: str, options: dict | None = None
    ) -> AsyncIterator[ExecutionHandle]:
        """Create an execution and terminate it on every exit, shielded and bounded.

        If terminate fails for good and the body raised nothing, ``GymError`` is raised (the
        episode must be rejected); if the body raised, its exception wins and the failure is
        logged and counted in ``stats["terminate_failed"]``.
        """
        created = await self.create_execution(task_id, options)
        handle = ExecutionHandle(self, created)
        failed = False
        try:
            yield handle
        except BaseException:
            failed = True
            raise
        finally:
            await handle._close(raise_on_failure=not failed)


class ExecutionHandle:
    """One live execution inside ``GenvClient.execution``."""

    def __init__(self, client: GenvClient, created: CreatedExecution):
        self.client = client
        self.created = created
        self.execution_id = created.execution_id
        self.task_id = created.task_id
        self.box_id = created.box_id
        self._terminate: asyncio.Task | None = None

    async def evaluate(
        self,
        execution_data: Any = None,
        answer_text: str | None = None,
        context_text: str | None = None,
        facts: Any = None,
    ) -> EvaluationResult:
        return await self.client.evaluate(
            self.execution_id, execution_data, answer_text, context_text, facts
        )

    async def terminate(self) -> None:
        """Terminate now (idempotent: the scope's exit then has nothing left to do)."""
        await self._close(raise_on_failure=True)

    async def _terminate_quietly(self) -> GymError | None:
        try:
            await self.client.terminate(self.execution_id)
            return None
        except GymError as e:
            self.client.stats["terminate_failed"] += 1
            log.error("could not terminate execution %s: %s", self.execution_id, e)
            return e

    async def _close(self, raise_on_failure: bool) -> None:
        if self._terminate is None:
            self._terminate = self.client._track(asyncio.ensure_future(self._terminate_quietly()))
        task = self._terminate
        cancelled = False
        # Cancellation must not skip the terminate: let it finish (it is bounded), then re-raise.
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        err = task.result()
        if err is not None and raise_on_failure:
            raise GymError(
                f"execution {self.execution_id} could not be terminated: {err}",
                status=err.status,
                body=err.body,
            )
