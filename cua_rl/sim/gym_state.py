"""The local gym's state: its configuration, its executions and what they share.

``SimGym`` owns live executions (each with the device its backend opened, see
``cua_rl/sim/device.py``), the screenshots kept after terminate (on disk: ``cua_rl.core.spill``),
the live cap, idle expiry, injected faults and the counters; ``gym_app`` serves it over HTTP and
``gym`` runs the server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import HTTPException, Request

from cua_rl.core.fields import doc
from cua_rl.core.spill import Spill, Spilled
from cua_rl.errors import ConfigError
from cua_rl.sim.browser import BrowserConfig
from cua_rl.sim.device import BACKENDS, Backend, Device, DeviceFailure
from cua_rl.sim.phone import CLOCKS

log = logging.getLogger(__name__)

OPS = ("create", "evaluate", "terminate")


@dataclass
class Fault:
    fail_rate: float = doc(0.0, "probability of answering 500 without doing the work")
    latency_s: float = doc(0.0, "seconds to wait before handling the call")
    drop_rate: float = doc(0.0, "probability of dropping the connection after the work is done")

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
    gym_id: str = doc("sim", "the {gym_id} path segment this server answers for")
    seed: int = doc(0, "seeds every execution's initial state and the fault dice")
    max_live: int = doc(256, "live executions allowed at once; more creates answer 429")
    idle_ttl_s: float = doc(900.0, "an execution untouched this long is expired (terminated)")
    screenshot_retention_s: float = doc(
        3600.0, "how long screenshots stay fetchable after terminate"
    )
    max_retained_executions: int = doc(
        4096, "terminated executions whose screenshots are kept (oldest dropped first)"
    )
    max_screenshots: int = doc(512, "screenshots one execution may capture")
    max_retained_bytes: int = doc(
        512 * 1024 * 1024, "PNG bytes kept for terminated executions (oldest dropped first)"
    )
    screenshot_spill_dir: str = doc(
        "",
        "directory of the files holding terminated executions' screenshots (unnamed temporary "
        "files, freed when the gym stops or dies); empty: the system's temporary directory",
    )
    clock: str = doc(
        "fixed",
        "phone: the status bar's clock: fixed (12:00: screenshots of one state are "
        "byte-identical) or ticking (a minute later after every action, as a real phone's "
        "clock moves; a state's screenshots then differ in the status bar)",
    )
    width: int = doc(360, "screenshot width in pixels")
    height: int = doc(640, "screenshot height in pixels")
    faults: dict[str, Fault] = doc(
        factory=dict, help="per-operation fault injection: create, evaluate, terminate"
    )
    backend: str = doc("phone", "the device behind an execution: 'phone' (simulated) or 'browser'")
    task_files: list[str] = doc(
        factory=list,
        help="the phone backend's YAML task files (docs/gym.md, 'Tasks of your own'): their "
        "tasks are served beside the built-in ones",
    )
    browser: BrowserConfig = doc(
        factory=BrowserConfig, help="the browser backend's settings (MiniWoB++ pages in Chromium)"
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
        if self.clock not in CLOCKS:
            raise ConfigError(f"clock={self.clock!r}: use one of {', '.join(CLOCKS)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.task_files and self.backend != "phone":
            raise ConfigError(
                "task files hold phone tasks (validators over the phone's state): use them with "
                "the phone backend, not --backend browser"
            )
        if isinstance(self.browser, dict):
            self.browser = BrowserConfig(**self.browser)
        self.faults = {
            op: f if isinstance(f, Fault) else Fault(**f) for op, f in self.faults.items()
        }


@dataclass
class Execution:
    execution_id: str
    task_id: str
    device: Device
    created_at: float
    last_active_at: float
    screenshots: list[bytes] = field(default_factory=list)
    status: str = "running"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def failure(self) -> str | None:
        return getattr(self.device, "failure", None)


def make_backend(config: SimGymConfig) -> Backend:
    if config.backend == "browser":
        from cua_rl.sim.browser import BrowserBackend

        return BrowserBackend(config.browser)
    from cua_rl.sim.phone_backend import PhoneBackend

    return PhoneBackend(config.width, config.height, config.clock, config.task_files)


class SimGym:
    def __init__(self, config: SimGymConfig | None = None, backend: Backend | None = None):
        self.config = config or SimGymConfig()
        self.backend = backend or make_backend(self.config)
        self.live: dict[str, Execution] = {}
        self._opening = 0  # creates between the cap check and their device being open
        # Terminated executions' screenshots, on disk: id -> (expires_at, where), oldest first
        # (None: it took none, or writing them failed).
        self.retained: OrderedDict[str, tuple[float, Spilled | None]] = OrderedDict()
        self.retained_bytes = 0
        self.spill = Spill(self.config.screenshot_spill_dir)
        self.counters = {
            "created": 0,
            "evaluations": 0,
            "terminated": 0,
            "expired": 0,
            "failed": 0,
            "rejected_cap": 0,
            # Most executions live at once (creates being opened included): what a client's
            # concurrency bound is checked against.
            "peak_live": 0,
            "faults": 0,
            "drops": 0,
            "spill_errors": 0,
        }
        # Requests held by an injected latency right now, per operation: tests wait on this to
        # act while a call is provably inside the gym, instead of sleeping and hoping.
        self.delaying: dict[str, int] = {}
        self._dice = random.Random(f"faults:{self.config.seed}")
        # The server's event loop (set when it starts): devices live on it.
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- executions -------------------------------------------------------------------------
    def get(self, execution_id: str) -> Execution:
        """A live, working execution (404 unknown, 409 terminated or failed)."""
        ex = self.live.get(execution_id)
        if ex is None:
            gone = execution_id in self.retained
            raise HTTPException(
                409 if gone else 404,
                detail=f"execution {execution_id} is {'terminated' if gone else 'unknown'}",
            )
        ex.last_active_at = time.time()
        if ex.failure is not None:
            raise self.note_failure(ex)
        return ex

    def note_failure(self, ex: Execution) -> HTTPException:
        """The answer for a call that found its device broken (counted once per execution)."""
        if ex.status != "failed":
            ex.status = "failed"
            self.counters["failed"] += 1
        return HTTPException(409, detail=f"execution {ex.execution_id} failed: {ex.failure}")

    async def create(self, task_id: str, options: dict) -> Execution:
        if self.backend.detail(task_id) is None:
            raise HTTPException(
                404, detail=f"unknown task {task_id!r}; GET /tasks lists the tasks served"
            )
        seed = options.get("seed", self.config.seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise HTTPException(400, detail="options.seed must be an integer")
        if len(self.live) + self._opening >= self.config.max_live:
            self.counters["rejected_cap"] += 1
            raise HTTPException(
                429,
                detail=f"too many live executions ({len(self.live)}/{self.config.max_live}); "
                "terminate some or raise --max-live",
            )
        self._opening += 1
        self.counters["peak_live"] = max(self.counters["peak_live"], len(self.live) + self._opening)
        try:
            device = await self.backend.open(task_id, seed)
        except DeviceFailure as exc:
            self.counters["failed"] += 1
            raise HTTPException(502, detail=f"could not open {task_id}: {exc}") from None
        finally:
            self._opening -= 1
        now = time.time()
        ex = Execution(f"ex-{uuid.uuid4().hex[:16]}", task_id, device, now, now)
        self.live[ex.execution_id] = ex
        self.counters["created"] += 1
        return ex

    async def terminate(self, execution_id: str, status: str = "terminated") -> bool:
        """Close an execution; False when it was already closed (terminate is idempotent)."""
        ex = self.live.pop(execution_id, None)
        if ex is None:
            return False
        ex.status = status
        self.counters["expired" if status == "expired" else "terminated"] += 1
        spilled = self._spill(ex)
        self.retained[execution_id] = (time.time() + self.config.screenshot_retention_s, spilled)
        self.retained_bytes += spilled.size if spilled else 0
        self._trim_retained()
        await ex.device.close()
        return True

    def _spill(self, ex: Execution) -> Spilled | None:
        """Move ``ex``'s screenshots out of memory; a disk error loses them, counted and logged."""
        shots, ex.screenshots = ex.screenshots, []
        if not shots or self.config.screenshot_retention_s == 0:
            return None
        try:
            return self.spill.write(shots)
        except OSError as e:
            self.counters["spill_errors"] += 1
            log.warning("screenshots of %s not kept: %s", ex.execution_id, e)
            return None

    def memory_screenshot_bytes(self) -> int:
        """PNG bytes the gym holds in memory: live executions' only (terminated ones spill)."""
        return sum(len(b) for ex in self.live.values() for b in ex.screenshots)

    def close_spill(self) -> None:
        """Drop every retained screenshot and free their files (the server is stopping)."""
        self.retained.clear()
        self.retained_bytes = 0
        self.spill.close()

    async def close_all(self) -> int:
        """Terminate every open execution (the server is stopping); returns how many."""
        ids = list(self.live)
        await asyncio.gather(*(self.terminate(eid, status="stopped") for eid in ids))
        return len(ids)

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
            _, spilled = self.retained.pop(oldest)
            if spilled is not None:
                self.retained_bytes -= spilled.size
                self.spill.remove(spilled)

    async def sweep(self) -> int:
        cutoff = time.time() - self.config.idle_ttl_s
        stale = [eid for eid, ex in self.live.items() if ex.last_active_at < cutoff]
        for eid in stale:
            await self.terminate(eid, status="expired")
        self._trim_retained()
        return len(stale)

    def screenshot_bytes(self, execution_id: str, index: int) -> bytes | None:
        ex = self.live.get(execution_id)
        if ex is not None:
            return ex.screenshots[index] if 0 <= index < len(ex.screenshots) else None
        expires, spilled = self.retained.get(execution_id, (0.0, None))
        if spilled is None or expires < time.time():
            return None
        return self.spill.read(spilled, index)

    async def inject(self, op: str, request: Request) -> None:
        """Latency and failure before the work; the drop decision is taken here, applied after."""
        f = self.config.faults.get(op)
        request.state.drop = False
        if f is None:
            return
        if f.latency_s:
            self.delaying[op] = self.delaying.get(op, 0) + 1
            try:
                await asyncio.sleep(f.latency_s)
            finally:
                self.delaying[op] -= 1
        if f.fail_rate and self._dice.random() < f.fail_rate:
            self.counters["faults"] += 1
            raise HTTPException(500, detail=f"injected {op} failure")
        if f.drop_rate and self._dice.random() < f.drop_rate:
            request.state.drop = True
