"""The browser backend of the local gym: MiniWoB++ pages in a headless Chromium.

One Chromium per gym, launched with the server and closed with it (Debian's ``chromium``,
driven by Playwright's async API on the gym's own event loop; Playwright's browser download is
never used). Each execution gets its own browser context, an incognito-like profile with its own
renderer process, storage and input: typing into one page cannot reach another, and a renderer
that crashes takes only its own execution down.

The model sees screenshots of the task area (160x210 CSS pixels) rendered at ``scale`` device
pixels per CSS pixel, so a screenshot is ``160*scale`` x ``210*scale`` real pixels and an action
at screenshot pixel (x, y) acts at CSS pixel (x/scale, y/scale) of the page.

Every page operation is bounded by ``op_timeout_s``: a page that stops answering (a script in an
endless loop) or a renderer that crashes fails its execution with the reason, its context is
closed at once, and every later call on it answers that reason.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass

from cua_rl.aio import within
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError
from cua_rl.logs import get_logger
from cua_rl.sim import miniwob
from cua_rl.sim.device import (
    ActionError,
    DeviceFailure,
    check_args,
    screen_point,
    text_arg,
    wait_seconds,
)

log = get_logger(__name__)

# Flags this machine kind needs: no sandbox (root, no user namespaces), no GPU, and nothing
# that phones home.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
KEYS = {
    "enter": "Enter",
    "backspace": "Backspace",
    "tab": "Tab",
    "escape": "Escape",
    "space": " ",
    "delete": "Delete",
    "up": "ArrowUp",
    "down": "ArrowDown",
    "left": "ArrowLeft",
    "right": "ArrowRight",
}
ACTIONS = ("tap", "click", "swipe", "scroll", "type", "key", "back", "home", "wait")
MAX_TYPED = 200
MAX_WAIT_S = 10.0


@dataclass
class BrowserConfig:
    executable: str = doc("", "the chromium binary; empty: `chromium` on PATH (`make browser`)")
    scale: float = doc(2.0, "screenshot pixels per CSS pixel of the 160x210 MiniWoB task area")
    tasks: list[str] = doc(
        factory=list, help="MiniWoB task names (or ids) served; empty: all of them"
    )
    reward: str = doc(
        "raw",
        (
            "the evaluate score: 'raw' (MiniWoB's raw reward, -1..1), 'discounted' "
            "(discounted by the time taken) or 'binary' (1 when the raw reward is positive)"
        ),
    )
    episode_max_time_s: float = doc(
        600.0, "MiniWoB's own episode timer; the page gives -1 when it runs out"
    )
    op_timeout_s: float = doc(
        15.0, "a page operation taking longer fails its execution (hung page)"
    )

    def __post_init__(self) -> None:
        if not 0.5 <= self.scale <= 8:
            raise ConfigError(f"browser scale={self.scale} must be within 0.5 .. 8")
        if self.reward not in miniwob.REWARD_MODES:
            raise ConfigError(f"browser reward={self.reward!r}: use one of {miniwob.REWARD_MODES}")
        if self.episode_max_time_s <= 0 or self.op_timeout_s <= 0:
            raise ConfigError("browser episode_max_time_s and op_timeout_s must be > 0 seconds")
        if not isinstance(self.tasks, list | tuple) or not all(
            isinstance(t, str) for t in self.tasks
        ):
            raise ConfigError("browser tasks must be a list of MiniWoB task names")
        self.tasks = list(self.tasks)

    def chromium(self) -> str:
        path = self.executable or shutil.which("chromium")
        if not path:
            raise ConfigError(
                "the browser gym needs Debian's chromium: `make browser` installs it, or set "
                "the browser executable"
            )
        return path


class BrowserDevice:
    """One execution: a browser context holding one MiniWoB page."""

    def __init__(self, config: BrowserConfig, task: miniwob.MiniWobTask, context, page):
        self.config, self.task = config, task
        self.context, self.page = context, page
        self.width = round(miniwob.TASK_WIDTH * config.scale)
        self.height = round(miniwob.TASK_HEIGHT * config.scale)
        self.failure: str | None = None
        self.utterance = ""
        self._ended = False
        self._closed = False  # closed on purpose (terminate, the gym stopping)
        self._closing: asyncio.Task | None = None
        page.on("crash", lambda _page: self._fail("the page's renderer crashed"))

    async def start(self, seed: int) -> None:
        cfg = self.config
        await self._run("loading the page", self.page.goto(self.task.page.as_uri()))
        await self._run(
            "waiting for the task", self.page.wait_for_function(miniwob.READY_JS, polling=50)
        )
        args = [seed, int(cfg.episode_max_time_s * 1000)]
        self.utterance = await self._run(
            "starting the episode", self.page.evaluate(miniwob.START_JS, args)
        )

    # -- the Device interface -------------------------------------------------------------
    async def screenshot(self) -> bytes:
        return await self._run(
            "a screenshot", self.page.screenshot(type="png", animations="allow", caret="initial")
        )

    async def act(self, name: str, args: dict) -> str | None:
        args = check_args(args)
        handler = getattr(self, f"_do_{name}", None) if name in ACTIONS else None
        if handler is None:
            raise ActionError(f"unknown action {name!r}; use one of {', '.join(ACTIONS)}")
        error = await handler(args)
        state = await self._state()
        self._ended = bool(state["done"])
        return error

    async def evaluate(self, answer_text: str | None) -> dict:
        return miniwob.result(await self._state(), self.config.reward)

    def label(self) -> str:
        return "ended" if self._ended else "task"

    async def state_key(self) -> str:
        """The page's state as its task sees it, hashed (``miniwob.STATE_KEY_JS``)."""
        return await self._run("reading the page's state", self.page.evaluate(miniwob.STATE_KEY_JS))

    async def close(self) -> None:
        self._closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_context())
        await asyncio.shield(self._closing)

    # -- actions (screenshot pixels in, CSS pixels to the page) ---------------------------
    def _point(self, args: dict, kx: str, ky: str) -> tuple[float, float]:
        x = screen_point(args, kx, self.width, self.height)
        y = screen_point(args, ky, self.width, self.height)
        return x / self.config.scale, y / self.config.scale

    async def _do_tap(self, args: dict) -> str | None:
        x, y = self._point(args, "x", "y")
        await self._run("a click", self.page.mouse.click(x, y))
        return None

    _do_click = _do_tap

    async def _do_swipe(self, args: dict) -> str | None:
        """A drag with the left button held: MiniWoB's drag tasks and sliders take it."""
        x1, y1 = self._point(args, "x1", "y1")
        x2, y2 = self._point(args, "x2", "y2")
        mouse = self.page.mouse

        async def drag() -> None:
            await mouse.move(x1, y1)
            await mouse.down()
            await mouse.move(x2, y2, steps=8)
            await mouse.up()

        await self._run("a drag", drag())
        return None

    async def _do_scroll(self, args: dict) -> str | None:
        x, y = self._point(args, "x", "y")
        delta = [args.get(k, 0) for k in ("dx", "dy")]
        if any(isinstance(d, bool) or not isinstance(d, int | float) for d in delta):
            raise ActionError("arguments 'dx' and 'dy' must be numbers of screenshot pixels")
        dx, dy = (d / self.config.scale for d in delta)

        async def wheel() -> None:
            await self.page.mouse.move(x, y)
            await self.page.mouse.wheel(dx, dy)

        await self._run("a scroll", wheel())
        return None

    async def _do_type(self, args: dict) -> str | None:
        text = text_arg(args)[:MAX_TYPED]
        await self._run("typing", self.page.keyboard.type(text))
        return None

    async def _do_key(self, args: dict) -> str | None:
        key = args.get("key")
        if not isinstance(key, str) or key.lower() not in (*KEYS, "back", "home"):
            raise ActionError(f"argument 'key' must be one of {', '.join(KEYS)}, back, home")
        if key.lower() in ("back", "home"):
            return await self._do_back(args)
        await self._run("a key press", self.page.keyboard.press(KEYS[key.lower()]))
        return None

    async def _do_back(self, args: dict) -> str | None:
        return "a MiniWoB page has no back or home; nothing happened"

    _do_home = _do_back

    async def _do_wait(self, args: dict) -> str | None:
        await asyncio.sleep(min(wait_seconds(args), MAX_WAIT_S))
        return None

    # -- failure handling -------------------------------------------------------------------
    async def _state(self) -> dict:
        return await self._run("reading the reward", self.page.evaluate(miniwob.STATE_JS))

    async def _run(self, what: str, call):
        """Await a page operation; a hang or a crash fails this device with the reason."""
        if self.failure is not None:
            call.close()
            raise DeviceFailure(self.failure)
        from playwright.async_api import Error as PlaywrightError

        timeout = self.config.op_timeout_s
        try:
            return await within(timeout, call)
        except TimeoutError:
            self._fail(f"the page did not answer {what} within {timeout:g}s (hung)")
        except PlaywrightError as exc:
            if self._closed:  # a call that raced its own terminate: not the page's fault
                raise DeviceFailure("the execution was closed") from None
            self._fail(f"the page failed during {what}: {str(exc).splitlines()[0][:200]}")
        raise DeviceFailure(self.failure)

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.warning("MiniWoB page %s failed: %s", self.task.name, reason)
        # Release the renderer now; the gym keeps the execution (failed) until its terminate.
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close_context())

    async def _close_context(self) -> None:
        try:
            await within(self.config.op_timeout_s, self.context.close())
        except Exception as exc:  # the browser itself may be gone; nothing is left to free
            log.warning("closing the context of %s: %s", self.task.name, exc)


class BrowserBackend:
    kind = "browser"

    def __init__(self, config: BrowserConfig | None = None):
        self.config = config or BrowserConfig()
        self.executable = self.config.chromium()  # a missing browser is a config error now
        self.tasks = miniwob.select(self.config.tasks)
        self.by_id = {t.task_id: t for t in self.tasks}
        self._pw = None
        self.browser = None
        self.browser_pid: int | None = None  # Chromium's browser process, for leak checks

    async def start(self) -> None:
        from playwright.async_api import async_playwright

        self._pw = await async_playwright().start()
        self.browser = await self._pw.chromium.launch(
            executable_path=self.executable, headless=True, args=list(CHROMIUM_ARGS)
        )
        cdp = await self.browser.new_browser_cdp_session()
        processes = (await cdp.send("SystemInfo.getProcessInfo"))["processInfo"]
        self.browser_pid = next(p["id"] for p in processes if p["type"] == "browser")
        await cdp.detach()

    async def stop(self) -> None:
        if self.browser is not None:
            await self.browser.close()
            self.browser = None
        if self._pw is not None:
            await self._pw.stop()
            self._pw = None

    def entries(self) -> list[dict]:
        return [
            {
                "task_id": t.task_id,
                "name": t.name,
                "task_number": t.number,
                "description": t.description,
                "instruction": t.instruction,
                "tags": [t.difficulty, t.family],
            }
            for t in self.tasks
        ]

    def detail(self, task_id: str) -> dict | None:
        t = self.by_id.get(task_id)
        if t is None:
            return None
        cfg = self.config
        entry = next(e for e in self.entries() if e["task_id"] == task_id)
        return {
            **entry,
            "meta": {"id": t.task_id, "number": t.number, "displayName": t.name},
            "env_config": {
                "type": "miniwob",
                "page": f"miniwob/{t.page.name}",
                "width": round(miniwob.TASK_WIDTH * cfg.scale),
                "height": round(miniwob.TASK_HEIGHT * cfg.scale),
                "scale": cfg.scale,
                "episode_max_time_s": cfg.episode_max_time_s,
            },
            # The page's own reward function decides; it reads no final answer.
            "evaluation": {
                "reward": cfg.reward,
                "validators": [{"id": "miniwob_reward"}],
                "reads_answer": False,
            },
        }

    async def open(self, task_id: str, seed: int) -> BrowserDevice:
        if self.browser is None:
            raise DeviceFailure("the browser gym is not started")
        cfg = self.config
        viewport = {"width": miniwob.TASK_WIDTH, "height": miniwob.TASK_HEIGHT}
        context = await within(
            cfg.op_timeout_s,
            self.browser.new_context(viewport=viewport, device_scale_factor=cfg.scale),
        )
        device = None
        try:
            page = await within(cfg.op_timeout_s, context.new_page())
            device = BrowserDevice(cfg, self.by_id[task_id], context, page)
            await device.start(seed)
            return device
        except BaseException:
            # A page that failed to load must not keep its renderer.
            await (device.close() if device is not None else context.close())
            raise
