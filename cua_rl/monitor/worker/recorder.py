"""Record one rollout, change by change, through a :class:`MonitorClient`.

Each method enqueues only the fields that changed (rollout fields already sent with the same
value are not sent again) and returns at once; no method awaits the network or raises into the
workflow. Records carry stable client ids derived from the rollout uuid (``{uuid}:env``,
``{uuid}:turn:{n}``, ``{uuid}:turn:{n}:action:{i}``, ``{uuid}:turn:{n}:obs:{i}``,
``{uuid}:validation``) and reference each other by client id, so they can be sent before the
server has answered, spooled and replayed, or sent twice, and still land exactly once.
``screenshot`` downscales and compresses a turn's image, hands it to the client's uploader and
records an observation that references it by hash (``sha256:<hex>``).

Rollout status: ``start`` creates it ``pending``; ``environment("creating")`` moves it to
``env_creation`` and ``environment("running")`` to ``running``; ``complete`` ends it
``completed``, ``fail(reason)`` ends it ``failed`` (``cancelled`` when the reason is
"cancelled"). Any method called before ``start`` starts the rollout first.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import (
    TERMINAL,
    action_client_id,
    environment_client_id,
    observation_client_id,
    turn_client_id,
    validation_client_id,
)
from cua_rl.monitor.worker.batches import utc_now
from cua_rl.monitor.worker.client import MonitorClient
from cua_rl.monitor.worker.context import MonitorContext, current, ref_field
from cua_rl.monitor.worker.uploader import (
    DEFAULT_MAX_EDGE,
    Fetch,
    prepare_screenshot,
    screenshot_bytes,
)

log = get_logger(__name__)


def _utc(epoch_s: float) -> str:
    """Epoch seconds in the layout of ``utc_now``."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


# The longest environment answer kept with an action (a refusal is a line; a full answer
# could be a whole page of state).
RESULT_CHARS = 500


def action_result(action: Mapping[str, Any]) -> dict[str, Any]:
    """What the environment answered an action (the agent's ``rawResult``), as the action's
    ``result`` field: ``ok`` / ``success`` and ``error`` as given, the rest as JSON cut to
    ``RESULT_CHARS``."""
    raw = action.get("rawResult")
    if not isinstance(raw, Mapping):
        return {} if raw is None else {"result": {"detail": str(raw)[:RESULT_CHARS]}}
    out: dict[str, Any] = {}
    for key in ("ok", "success"):
        if isinstance(raw.get(key), bool):
            out[key] = raw[key]
    if raw.get("error"):
        out["error"] = str(raw["error"])[:RESULT_CHARS]
    rest = {k: v for k, v in raw.items() if k not in ("ok", "success", "error")}
    if rest:
        text = json.dumps(rest, default=str)
        out["detail"] = text if len(text) <= RESULT_CHARS else text[:RESULT_CHARS] + "..."
    return {"result": out}


class RolloutRecorder:
    """Recorder of one rollout. ``client=None`` or a missing source makes every call a no-op."""

    def __init__(
        self,
        client: MonitorClient | None,
        rollout_uuid: str,
        *,
        task_id: str,
        model_path: str,
        source: MonitorContext | None = None,
        task: dict[str, Any] | None = None,
        env_type: str = "android",
        **fields: Any,
    ):
        self.client = client
        self.uuid = rollout_uuid
        self.task_id = task_id
        self.model_path = model_path
        self.env_type = env_type
        self.task = dict(task or {})
        self.fields = fields
        ctx = source if source is not None else current()
        self.source = ctx.source()
        if client is not None and self.source is None:
            log.warning(
                "monitor: rollout %s has no step/eval/baseline in context; not recorded",
                rollout_uuid,
            )
        self.enabled = client is not None and self.source is not None
        self._sent: dict[str, Any] = {}
        self._env_sent = False
        self._t0: float | None = None
        self._turn_t0: dict[int, float] = {}
        self._turns: set[int] = set()
        self._actions: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ helpers

    def turn_client_id(self, n: int) -> str:
        return turn_client_id(self.uuid, n)

    def _enqueue(self, kind: str, record: dict[str, Any]) -> None:
        if self.enabled:
            self.client.enqueue(kind, record)

    def _rollout(self, **fields: Any) -> None:
        changed = {k: v for k, v in fields.items() if k not in self._sent or self._sent[k] != v}
        if not changed:
            return
        self._sent.update(changed)
        self._enqueue("rollouts", {"client_id": self.uuid, **changed})

    # ------------------------------------------------------------------ lifecycle

    async def start(self, **fields: Any) -> None:
        """Create the task (upsert) and the rollout; later calls only send changed fields."""
        if not self.enabled:
            return
        if self._t0 is not None:
            self._rollout(**fields)
            return
        self._t0 = time.monotonic()
        task = {"name": self.task_id, "description": "", **self.task}
        self._enqueue("tasks", {"client_id": self.task_id, "task_id": self.task_id, **task})
        kind, ref = self.source
        record = {
            "rollout_id": self.uuid,
            "source_type": kind,
            **ref_field(kind, ref),
            "task_client_id": self.task_id,
            "model_path": self.model_path,
            "is_eval": 1 if kind == "eval" else 0,
            "status": "pending",
            "start_time": utc_now(),
            **self.fields,
            **fields,
        }
        self._rollout(**record)

    async def _ensure_started(self) -> None:
        # A record that references the rollout must follow its creation in the queue; a caller
        # that fails before start() still gets a complete rollout row.
        if self._t0 is None:
            await self.start()

    async def environment(self, status: str, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        record: dict[str, Any] = {
            "client_id": environment_client_id(self.uuid),
            "rollout_client_id": self.uuid,
            "status": status,
        }
        if not self._env_sent:
            record["env_type"] = fields.pop("env_type", self.env_type)
            self._env_sent = True
        now = utc_now()
        if status == "creating":
            record["creation_time"] = now
        if status in TERMINAL["environment"]:
            record["termination_time"] = now
        record.update(fields)
        self._enqueue("environments", record)
        # The rollout's own status follows the environment until the task runs; it never moves
        # back (terminated/error after the task are the environment's business).
        if status == "creating" and self._sent.get("status") == "pending":
            self._rollout(status="env_creation", current_phase="env_creation")
        elif status == "running" and self._sent.get("status") in ("pending", "env_creation"):
            self._rollout(
                status="running",
                current_phase="task_execution",
                env_creation_time=now,
                task_start_time=now,
            )

    async def turn_start(self, n: int, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        self._turn_t0[n] = time.monotonic()
        self._turns.add(n)
        self._enqueue(
            "turns",
            {
                "client_id": self.turn_client_id(n),
                "rollout_client_id": self.uuid,
                "turn": n,
                "start_time": utc_now(),
                **fields,
            },
        )
        self._rollout(current_turn=n)

    async def turn_end(
        self,
        n: int,
        *,
        model_response: str | None = None,
        timings: dict[str, float] | None = None,
        **fields: Any,
    ) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        self._turns.add(n)
        record: dict[str, Any] = {
            "client_id": self.turn_client_id(n),
            "rollout_client_id": self.uuid,
            "turn": n,
            "end_time": utc_now(),
        }
        if n in self._turn_t0:
            record["turn_time"] = time.monotonic() - self._turn_t0.pop(n)
        if model_response is not None:
            record["model_response"] = model_response
        if timings is not None:
            record["metrics_json"] = {"timings": timings, **(fields.pop("metrics", None) or {})}
        record.update(fields)
        self._enqueue("turns", record)

    async def action(
        self,
        turn: int,
        index: int,
        name: str,
        args: dict[str, Any] | None = None,
        *,
        tokens: list | None = None,
        logprobs: list | None = None,
        num_tokens: int | None = None,
        **fields: Any,
    ) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        if turn not in self._turns:  # the action's turn row must exist before it
            await self.turn_start(turn)
        self._actions.add((turn, index))
        record: dict[str, Any] = {
            "client_id": action_client_id(self.uuid, turn, index),
            "turn_client_id": self.turn_client_id(turn),
            "action_type": fields.pop("action_type", name),
            "tool_name": name,
            "tool_args": args if args is not None else {},
        }
        if tokens is not None:
            record["tokens"] = tokens
        if logprobs is not None:
            record["logprobs"] = logprobs
        if num_tokens is None and tokens is not None:
            num_tokens = len(tokens)
        if num_tokens is not None:
            record["num_tokens"] = num_tokens
        record.update(fields)
        self._enqueue("actions", record)

    async def observation(self, turn: int, index: int, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        if turn not in self._turns:
            await self.turn_start(turn)
        self._enqueue(
            "observations",
            {
                "client_id": observation_client_id(self.uuid, turn, index),
                "turn_client_id": self.turn_client_id(turn),
                **fields,
            },
        )

    async def record_turns(
        self,
        turns: list,
        *,
        images: Mapping[str, bytes] | None = None,
        fetch: Fetch | None = None,
    ) -> None:
        """Each turn of an episode (``cua_rl.trajectory.Turn``): the reply, its actions (the
        reply's tokens and logprobs on the first: one reply per turn) with what the environment
        answered each (``result``: the gym's refusal of an off-screen tap, say), and the
        screenshots the model received: its last image, the turn's own, as observation 0, from
        ``images`` when the bytes are in hand (the gateway captured them), else decoded or
        fetched (``fetch``) from its URL; the request's earlier images (a MAI-UI window of
        three) as observations 1.., each marked with its place in the request and reusing the
        stored screenshot of the turn it came from."""
        if not self.enabled:
            return
        kept: dict[str, dict[str, Any]] = {}  # an image URL -> its observation's fields
        for turn in turns:
            n = turn.step
            # The agent's own step times: turns are recorded after the episode, when the
            # recorder's clock would give every turn the same instant and no duration.
            began, ended = getattr(turn, "started_at", None), getattr(turn, "ended_at", None)
            timed = began is not None and ended is not None
            await self.turn_start(n, **({"start_time": _utc(began)} if timed else {}))
            metrics = dict(getattr(turn, "notes", None) or {}) or None
            await self.turn_end(
                n,
                **({"end_time": _utc(ended), "turn_time": ended - began} if timed else {}),
                model_response=turn.text,
                finish_reason=turn.finish_reason,
                prompt_tokens=len(turn.prompt_ids or []),
                output_tokens=len(turn.output_ids or []),
                **({"metrics_json": metrics} if metrics else {}),
            )
            for i, action in enumerate(turn.actions):
                await self.action(
                    n,
                    i,
                    str(action.get("name", "unknown")),
                    dict(action.get("args") or {}),
                    tokens=list(turn.output_ids or []) if i == 0 else None,
                    logprobs=list(turn.output_logprobs or []) if i == 0 else None,
                    **action_result(action),
                )
            urls = list(turn.image_urls or [])
            if not urls:
                continue
            # Observation 0 is the turn's own (the last image); 1.. the request's earlier ones.
            order = [urls[-1], *urls[:-1]]
            for index, url in enumerate(order):
                place = len(urls) if index == 0 else index
                fields = {"context_image": place, "context_images": len(urls)}
                if len(urls) == 1:
                    fields = {}
                if url in kept:
                    await self.observation(n, index, **kept[url], **fields)
                else:
                    source = (images or {}).get(url, url)
                    kept[url] = await self.screenshot(n, index, source, fetch=fetch, **fields)

    async def screenshot(
        self,
        turn: int,
        index: int,
        source: bytes | str,
        *,
        fetch: Fetch | None = None,
        max_edge: int = DEFAULT_MAX_EDGE,
        **fields: Any,
    ) -> dict[str, Any]:
        """The screenshot the model saw at ``turn``, kept by the monitor's screenshot store.

        ``source`` is the image bytes, a data: URL, or an http(s) URL that ``fetch`` reads
        (presigned URLs expire; without ``fetch`` only the URL is recorded). The image is
        downscaled and compressed in a thread, queued for upload, and the observation references
        it by hash with the size the agent saw. A screenshot that cannot be read is recorded as
        a note on the observation; nothing raises into the caller. Returns the observation's
        screenshot fields (for another observation of the same image).
        """
        if not self.enabled:
            return {}
        record: dict[str, Any] = {"obs_type": "screenshot"}
        if isinstance(source, str):
            record["source_url"] = (
                source if not source.startswith("data:") else (f"data-url:{len(source)}B")
            )
        try:
            raw = await screenshot_bytes(source, fetch)
            if raw is None:
                record["screenshot_uri"] = source
            else:
                shot = await asyncio.to_thread(prepare_screenshot, raw, max_edge=max_edge)
                self.client.put_screenshot(shot)
                record.update(shot.observation_fields())
        except Exception as exc:  # a bad image costs its picture, never the episode
            record["screenshot_error"] = f"{type(exc).__name__}: {exc}"[:500]
            if isinstance(source, str) and not source.startswith("data:"):
                record["screenshot_uri"] = source
            log.warning("monitor: screenshot of turn %d not kept: %s", turn, exc)
        await self.observation(turn, index, **record, **fields)
        return record

    async def validation(self, *, success: bool, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        now = utc_now()
        self._enqueue(
            "validations",
            {
                "client_id": validation_client_id(self.uuid),
                "rollout_client_id": self.uuid,
                "success": bool(success),
                "validation_time": now,
                **fields,
            },
        )
        self._rollout(validation_passed=int(bool(success)), validation_time=now)

    def _final(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "end_time": utc_now(),
            "num_turns": len(self._turns),
            "num_total_actions": len(self._actions),
        }
        if self._t0 is not None:
            out["rollout_time"] = time.monotonic() - self._t0
        return out

    async def note(self, **fields: Any) -> None:
        """Fields of the rollout that change no status (those the schema does not name are kept
        in its ``extra``): a free-reward episode's mark (cua_rl/audit/live.py)."""
        if not self.enabled:
            return
        await self._ensure_started()
        self._rollout(**fields)

    async def complete(self, *, reward: float, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        self._rollout(
            **{
                "status": "completed",
                "reward": reward,
                "progress_percent": 100.0,
                **self._final(),
                **fields,
            }
        )

    async def fail(self, reason: str, **fields: Any) -> None:
        if not self.enabled:
            return
        await self._ensure_started()
        # A cancelled episode is not a failed one (the seed has a status for each).
        status = "cancelled" if reason == "cancelled" else "failed"
        self._rollout(
            **{
                "status": status,
                "error_message": reason,
                "status_message": reason,
                **self._final(),
                **fields,
            }
        )
