"""The Training Monitor client used during training: batching, retrying, spooling, never raising.

``enqueue(kind, record)`` only appends to an in-memory queue and returns; a background task on
the event loop turns the queue into batches (``batch_max_records`` or ``flush_interval_s``) and
posts them one at a time, so batches reach the server in the order they were made. A batch that
fails with a transport error, a 5xx, 408 or 429 is retried with exponential backoff; when retries
run out it is appended to a local JSONL spool, and while the spool is not empty every new batch
goes there too (order is kept), until a replay succeeds. Each batch carries an idempotency key
(``BATCH_KEY_HEADER``), the same on every resend and replay, and kept with the batch in the
spool: a batch that was committed but whose answer was lost is not applied twice (upserts by
client id alone would walk a record back through the status changes the batch holds).

A 422 names the record it refused; that record is dropped (counted) and the rest re-sent, so one
bad record does not lose its batch. Counters: ``sent``, ``retried``, ``spooled``, ``replayed``,
``dropped`` (records, except ``retried`` which counts attempts). Nothing here raises into the
caller; failures are logged and counted.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from cua_rl.aio import within
from cua_rl.errors import MonitorError
from cua_rl.logs import get_logger
from cua_rl.monitor.protocol import (
    BATCH_KEY_HEADER,
    BATCH_ORDER,
    EPISODE_KIND,
    IMAGE_KIND,
    baseline_client_id,
    eval_client_id,
    step_client_id,
)
from cua_rl.monitor.worker import spool
from cua_rl.monitor.worker.batches import count, dumps, ref, split
from cua_rl.monitor.worker.settings import MonitorClientConfig, MonitorCounters
from cua_rl.monitor.worker.uploader import PreparedScreenshot, ScreenshotUploader
from cua_rl.warehouse.episode import StoredEpisode, episode_from_json, to_record

log = get_logger(__name__)

BATCH_KEYS = BATCH_ORDER
# Image hashes one client remembers having queued (each is sent once per client).
_REMEMBER_IMAGES = 20_000
_MERGEABLE = frozenset({"tasks", "turns", "actions", "observations", "validations"})
_RETRYABLE = {408, 425, 429, 500, 502, 503, 504}
# The monitor is there but will not take this batch now (bad token, wrong URL): keep it.
_SPOOL_STATUSES = {401, 403, 404}
# Records the trainer process sends: a rollout worker's record may name one before the trainer's
# batch (or its spool, after a monitor restart) reaches the monitor, so such a refusal waits.
_OTHER_PROCESS_KINDS = frozenset({"training", "step", "eval", "baseline"})
# A spool line: the batch and its idempotency key (lines spooled before keys were sent hold the
# bare batch, replayed without one).
_SPOOLED_KEY, _SPOOLED_BATCH = "idempotency_key", "batch"


def new_batch_key() -> str:
    return uuid.uuid4().hex


class MonitorClient:
    """Async, batching monitor client. Use as ``async with MonitorClient(cfg) as client``."""

    def __init__(self, config: MonitorClientConfig, *, client: httpx.AsyncClient | None = None):
        self.config = config
        self.counters = MonitorCounters()
        self._http = client
        self._owns_http = client is None
        self._queue: collections.deque[tuple[str, dict]] = collections.deque()
        self._lock = threading.Lock()  # enqueue may come from other threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._stopping = False
        self._inflight: tuple[dict[str, Any], str] | None = None  # a batch and its key
        # Claimed at the first spooled batch (docs in spool.py), or now to replay what a dead
        # client left at the configured path.
        self._spool: Path | None = None
        self._spool_fd: int | None = None
        self._spool_pending = False
        left = spool.adopt(Path(config.spool_path))
        if left is not None:
            (self._spool, self._spool_fd), self._spool_pending = left, True
        self._next_replay = 0.0
        self._waiting_since: float | None = None  # head batch refused for a missing reference
        self._images_sent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.screenshots = ScreenshotUploader(
            config.base_url,
            config.token,
            max_queue_bytes=config.max_screenshot_queue_bytes,
            max_retries=config.max_retries,
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            timeout_s=config.request_timeout_s,
        )

    # ------------------------------------------------------------------ public API

    async def __aenter__(self) -> MonitorClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = self._closing = False
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.request_timeout_s)
        self._task = self._loop.create_task(self._run(), name="monitor-client")
        self.screenshots.start(self._http)

    def enqueue(self, kind: str, record: dict[str, Any]) -> bool:
        """Queue one record (``kind`` is a batch key); never blocks or raises. False if dropped."""
        try:
            if kind not in BATCH_KEYS or not isinstance(record, dict):
                raise ValueError(f"unknown kind {kind!r} or record not a dict")
            with self._lock:
                if len(self._queue) >= self.config.max_queue_records:
                    self.counters.dropped += 1
                    self.counters.last_error = "queue full"
                    return False
                self._queue.append((kind, record))
                big = len(self._queue) >= self.config.batch_max_records
            if big:
                self._poke()
            return True
        except Exception as exc:  # never into the caller
            self.counters.dropped += 1
            self.counters.last_error = f"enqueue: {exc}"
            log.warning("monitor: record dropped: %s", exc)
            return False

    def put_screenshot(self, shot: PreparedScreenshot) -> bool:
        """Queue an image for ``PUT /api/screenshots/<hash>``; never blocks or raises."""
        return self.screenshots.put(shot)

    def store_episode(self, episode: StoredEpisode) -> bool:
        """Queue an accepted episode for the trajectory warehouse: its images this client has
        not queued before (``episode_images``), then its ``episodes`` record. Both go the way of
        every record (batched, retried, spooled while the monitor is down, a refusal counted);
        never blocks or raises. False when a record was dropped."""
        try:
            ok = True
            for digest in episode.image_hashes:
                if digest in self._images_sent:
                    continue
                data = base64.b64encode(episode.images[digest]).decode("ascii")
                if not self.enqueue(IMAGE_KIND, {"sha256": digest, "data": data}):
                    ok = False  # dropped (counted): a later episode holding it sends it again
                    continue
                self._images_sent[digest] = None
                while len(self._images_sent) > _REMEMBER_IMAGES:
                    self._images_sent.popitem(last=False)
            return self.enqueue(EPISODE_KIND, to_record(episode)) and ok
        except Exception as exc:  # never into the caller
            self.counters.dropped += 1
            self.counters.last_error = f"store_episode: {type(exc).__name__}: {exc}"
            log.warning("monitor: episode not stored: %s", exc)
            return False

    # ------------------------------------------------------------------ warehouse reads
    # Unlike the records above, reads answer now: a failure raises MonitorError.

    async def successes(
        self,
        task_id: str,
        trainings: list[str],
        min_version: int,
        limit: int,
        max_version: int | None = None,
    ) -> list[StoredEpisode]:
        """Recorded successful episodes of ``task_id`` (newest first, at most ``limit``) from
        the trainings named by run name (empty: any training) whose every token was sampled at
        policy version ``min_version`` or later (and ``max_version`` or earlier, if given), each
        with its images fetched (``rebuild_rows`` takes it as it is). Episodes whose images the
        monitor lacks are left out by the server (counted in its answer's ``skipped``)."""
        params: list[tuple[str, str | int]] = [
            ("task_id", task_id),
            ("min_version", int(min_version)),
            ("limit", int(limit)),
            *((("max_version", int(max_version)),) if max_version is not None else ()),
            *(("training", t) for t in trainings),
        ]
        body = await self._get_json("/api/episodes/successes", params)
        episodes = [episode_from_json(e) for e in body["episodes"]]
        cache: dict[str, bytes] = {}
        for ep in episodes:
            for digest in ep.image_hashes:
                if digest not in cache:
                    cache[digest] = await self.screenshot(digest)
                ep.images[digest] = cache[digest]
        return episodes

    async def screenshot(self, sha256: str) -> bytes:
        """The stored image ``sha256`` (``GET /api/screenshots/<hex>``)."""
        resp = await self._get(f"/api/screenshots/{sha256}", [])
        return resp.content

    async def _get(self, path: str, params: list) -> httpx.Response:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.config.request_timeout_s)
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        try:
            resp = await self._http.get(
                f"{self.config.base_url}{path}",
                params=params,
                headers=headers,
                timeout=self.config.request_timeout_s,
            )
        except httpx.HTTPError as exc:
            raise MonitorError(f"GET {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise MonitorError(
                f"GET {path} answered {resp.status_code}: {resp.text[:300]}",
                status=resp.status_code,
                body=resp.text[:2000],
            )
        return resp

    async def _get_json(self, path: str, params: list) -> dict[str, Any]:
        resp = await self._get(path, params)
        try:
            return resp.json()
        except ValueError as exc:
            raise MonitorError(f"GET {path}: the answer is not JSON") from exc

    async def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until everything queued so far reached the server; False on timeout.

        Bounded by default so a monitor that stays down cannot hold the caller; what did not go
        out stays queued or spooled. ``timeout=None`` waits for as long as it takes."""
        if self._task is None:
            return not self._queue and not self._spool_pending
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._queue or self._busy or self._spool_pending or not self.screenshots.idle:
            if self._task.done() or (deadline is not None and loop.time() >= deadline):
                return False
            self._poke()
            await asyncio.sleep(0.02)
        return True

    async def close(self, timeout: float = 10.0) -> None:
        """Flush for up to ``timeout`` s; anything unsent is spooled, then the task stops.

        Bounded: a POST that hangs is cancelled and its batch spooled (the server upserts by
        client id, so a batch that was in fact committed is harmless to replay).
        """
        if self._task is None:
            if self._owns_http and self._http is not None:  # send_now without start()
                await self._http.aclose()
                self._http = None
            return
        self._closing = True  # replay the spool without waiting for the interval
        await self.flush(timeout)
        # Stop by flag, not only by cancel: on Python 3.11 ``wait_for`` can swallow a cancel that
        # races with the wake event, which would leave ``await task`` waiting forever.
        self._stopping = True
        self._poke()
        task = self._task
        done, _ = await asyncio.wait({task}, timeout=min(1.0, timeout))
        if not done:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:  # pragma: no cover - only a worker stuck outside any await
            log.error("monitor: client worker did not stop; abandoning it")
        elif not task.cancelled() and task.exception() is not None:
            self.counters.last_error = f"worker: {task.exception()}"
        # The batch that was in flight, then whatever is still queued, go to the spool (in that
        # order) so a later client on the same spool path replays them.
        inflight, self._inflight = self._inflight, None
        if inflight and inflight[0]:
            await self._spool_batch(*inflight)
        leftover = self._take(len(self._queue)) if self._queue else None
        if leftover:
            await self._spool_batch(leftover, new_batch_key())
        await self.screenshots.stop()
        if self._owns_http and self._http is not None:
            await self._http.aclose()
            self._http = None  # a later start() makes a fresh one
        self._task = None
        if self._spool_fd is not None:  # a later client may now claim and replay what is left
            spool.release(self._spool, self._spool_fd)
            self._spool, self._spool_fd, self._spool_pending = None, None, False

    @property
    def pending(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ training-level records
    # Helpers for the trainer: each queues one record with its protocol.py client id and returns
    # that id, which later records (and MonitorContext) use as the reference. ``training`` may be
    # the training's server id (int) or its client id (the run name, str).

    def training(self, run_name: str, **fields: Any) -> str:
        """Create or update the training; its client id is the run name."""
        self.enqueue("training", {"client_id": run_name, "run_name": run_name, **fields})
        return run_name

    def step(self, training: int | str, step: int, *, batch: int = 0, **fields: Any) -> str:
        client_id = step_client_id(training, step, batch)
        record = {"client_id": client_id, **ref("training", training), "step": step}
        self.enqueue("steps", {**record, "batch": batch, **fields})
        return client_id

    def eval(self, training: int | str, step: int, **fields: Any) -> str:
        client_id = eval_client_id(training, step)
        record = {"client_id": client_id, **ref("training", training), "step": step}
        self.enqueue("evals", {**record, **fields})
        return client_id

    def baseline(self, training: int | str, *, client_id: str | None = None, **fields: Any) -> str:
        """Create (or, given the ``client_id`` it returned, update) a baseline evaluation."""
        if client_id is None:
            client_id = baseline_client_id(training, datetime.now(UTC).isoformat())
        self.enqueue("baselines", {"client_id": client_id, **ref("training", training), **fields})
        return client_id

    async def send_now(self, batch: dict[str, Any]) -> dict[str, Any] | None:
        """POST one batch directly (bypassing the queue) and return the server's answer, or None
        on any failure (counted, never raised). For start-up records whose server ids the caller
        needs; everything else should go through the queue."""
        try:
            if self._http is None:
                self._http = httpx.AsyncClient(timeout=self.config.request_timeout_s)
            resp = await self._post(batch)
            if resp.status_code == 200:
                self.counters.sent += count(batch)
                return resp.json()
            self.counters.last_error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        except Exception as exc:
            self.counters.last_error = f"send_now: {type(exc).__name__}: {exc}"
        log.warning("monitor: send_now failed: %s", self.counters.last_error)
        return None

    # ------------------------------------------------------------------ worker

    _busy = False

    def _poke(self) -> None:
        if self._wake is None or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _take(self, n: int) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        slots: dict[tuple[str, str], int] = {}
        with self._lock:
            for _ in range(min(n, len(self._queue))):
                kind, record = self._queue.popleft()
                if kind == "training":
                    if "training" in batch:  # one training object per batch: merge updates
                        batch["training"] = {**batch["training"], **record}
                    else:
                        batch["training"] = record
                    continue
                records = batch.setdefault(kind, [])
                cid = record.get("client_id")
                if kind in _MERGEABLE and isinstance(cid, str):
                    # A turn's start and end in one batch become one record (later fields win).
                    # Only kinds without a status: merging a status change would hide it from
                    # status_history.
                    slot = slots.get((kind, cid))
                    if slot is not None:
                        records[slot] = {**records[slot], **record}
                        continue
                    slots[(kind, cid)] = len(records)
                records.append(record)
        return batch

    async def _run(self) -> None:
        cfg = self.config
        while not self._stopping:
            try:
                try:
                    await within(cfg.flush_interval_s, self._wake.wait())
                except TimeoutError:
                    pass
                self._wake.clear()
                if self._stopping:
                    return
                self._busy = True
                try:
                    if self._spool_pending:
                        await self._maybe_replay()
                    while self._queue and not self._stopping:
                        batch, key = self._take(cfg.batch_max_records), new_batch_key()
                        # Owned by the worker until delivered or spooled; close() spools it if
                        # the worker is cancelled in between.
                        self._inflight = (batch, key)
                        if self._spool_pending:
                            await self._spool_batch(batch, key)
                        else:
                            await self._deliver(batch, key)
                        self._inflight = None
                finally:
                    self._busy = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the worker must survive anything
                self.counters.last_error = f"worker: {exc}"
                log.exception("monitor: client worker error")
                await asyncio.sleep(cfg.flush_interval_s)

    async def _post(self, batch: dict[str, Any], key: str | None = None) -> httpx.Response:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers[BATCH_KEY_HEADER] = key
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        return await self._http.post(
            f"{self.config.base_url}/api/ingest/batch",
            content=dumps(batch),
            headers=headers,
            timeout=self.config.request_timeout_s,
        )

    async def _deliver(
        self, batch: dict[str, Any], key: str, *, retries: int | None = None
    ) -> bool:
        """Send with retries; spool on failure. True when the server took it (or parts of it).
        ``key``: its idempotency key, on every attempt."""
        cfg = self.config
        retries = cfg.max_retries if retries is None else retries
        delay = cfg.backoff_initial_s
        attempt = 0
        while batch:
            outcome = await self._attempt(batch, key)
            if outcome == "ok":
                return True
            if outcome == "dropped-one":
                continue  # the refused record was removed; send the rest now
            if outcome == "spool" or attempt >= retries:
                await self._spool_batch(batch, key)
                return False
            attempt += 1
            self.counters.retried += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.backoff_max_s)
        return True

    async def _attempt(self, batch: dict[str, Any], key: str | None) -> str:
        """One POST. A refused batch was not applied (its transaction rolled back), so what is
        left of it after a refused record is dropped goes again under the same key."""
        try:
            resp = await self._post(batch, key)
        except httpx.HTTPError as exc:
            self.counters.last_error = f"{type(exc).__name__}: {exc}"
            return "retry"
        if resp.status_code == 200:
            self.counters.sent += count(batch)
            self._waiting_since = None
            return "ok"
        self.counters.last_error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        if resp.status_code in _RETRYABLE:
            return "retry"
        if resp.status_code in _SPOOL_STATUSES:
            return "spool"
        if resp.status_code == 422 and self._awaits_another_process(resp):
            return "spool"
        if resp.status_code == 422 and self._drop_refused(batch, resp):
            return "dropped-one"
        if resp.status_code == 413 and count(batch) > 1:
            first, second = split(batch)
            # Keys of their own, derived: the halves of a replayed batch get the same ones.
            base = key or new_batch_key()
            await self._deliver(first, f"{base}.1")
            await self._deliver(second, f"{base}.2")
            batch.clear()
            return "ok"
        log.warning(
            "monitor: batch of %d records refused: %s", count(batch), self.counters.last_error
        )
        self.counters.dropped += count(batch)
        batch.clear()
        return "ok"

    def _awaits_another_process(self, resp: httpx.Response) -> bool:
        """A record names a training/step/eval/baseline the monitor lacks: keep the batch in
        the spool (order kept) for up to ``reference_wait_s``, then refuse it as any other."""
        try:
            missing = (resp.json()["error"]["details"] or {}).get("missing_reference")
        except Exception:
            return False
        if missing not in _OTHER_PROCESS_KINDS:
            return False
        now = self._loop.time()
        if self._waiting_since is None:
            self._waiting_since = now
            log.info(
                "monitor: a record names its %s, not recorded yet; it waits in the spool", missing
            )
        if now - self._waiting_since > self.config.reference_wait_s:
            self._waiting_since = None
            return False
        self.counters.waited += 1
        return True

    def _drop_refused(self, batch: dict[str, Any], resp: httpx.Response) -> bool:
        try:
            details = resp.json()["error"]["details"] or {}
            kind, index = details.get("kind"), details.get("index")
        except Exception:
            return False
        log.warning("monitor: record refused and dropped: %s", self.counters.last_error)
        self.counters.refused[f"{kind}.{details.get('field') or 'record'}"] += 1
        if kind == "training" and "training" in batch:
            del batch["training"]
        elif kind in batch and isinstance(index, int) and 0 <= index < len(batch[kind]):
            del batch[kind][index]
            if not batch[kind]:
                del batch[kind]
        else:
            return False
        self.counters.dropped += 1
        return True

    # ------------------------------------------------------------------ spool

    async def _spool_batch(self, batch: dict[str, Any], key: str) -> None:
        if not batch:
            return
        line = dumps({_SPOOLED_KEY: key, _SPOOLED_BATCH: batch}) + b"\n"
        try:
            if self._spool is None:
                self._spool, self._spool_fd = spool.claim(Path(self.config.spool_path))
            await asyncio.to_thread(spool.append_line, self._spool, line)
        except OSError as exc:
            self.counters.dropped += count(batch)
            self.counters.last_error = f"spool write failed: {exc}"
            log.error("monitor: could not spool %d records: %s", count(batch), exc)
            return
        self.counters.spooled += count(batch)
        if not self._spool_pending:
            self._next_replay = self._loop.time() + self.config.replay_interval_s
        self._spool_pending = True

    async def _maybe_replay(self) -> None:
        if self._loop.time() < self._next_replay and not self._closing:
            return
        self._next_replay = self._loop.time() + self.config.replay_interval_s
        lines = await asyncio.to_thread(spool.read_lines, self._spool)
        done = 0
        for line in lines:
            try:
                batch, key = spooled(json.loads(line))
            except ValueError:
                self.counters.dropped += 1
                self.counters.last_error = "corrupt spool line skipped"
                done += 1
                continue
            sent_before = self.counters.sent
            outcome = await self._attempt(batch, key)
            while batch and outcome == "dropped-one":
                outcome = await self._attempt(batch, key)
            if outcome in ("retry", "spool") and batch:
                break
            self.counters.replayed += self.counters.sent - sent_before
            done += 1
        # Only the replayed prefix goes; lines appended meanwhile stay, in order.
        remaining = await asyncio.to_thread(spool.drop_prefix, self._spool, done)
        self._spool_pending = remaining > 0


def spooled(line: Any) -> tuple[dict[str, Any], str | None]:
    """A spool line's batch and idempotency key (None for a bare batch of an older spool)."""
    if isinstance(line, dict) and set(line) == {_SPOOLED_KEY, _SPOOLED_BATCH}:
        batch, key = line[_SPOOLED_BATCH], line[_SPOOLED_KEY]
        if isinstance(batch, dict) and isinstance(key, str):
            return batch, key
    if not isinstance(line, dict):
        raise ValueError("a spool line is a JSON object")
    return line, None
