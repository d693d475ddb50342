"""A real headless Chromium for the dashboard's tests: Debian's package, driven by Playwright's
Python API with ``executable_path`` (Playwright's own browser download cannot run here), a fresh
profile per browser, and every console error, failed request and HTTP error recorded."""

from __future__ import annotations

import shutil

import pytest

BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Playwright's 30 s default is a bound on the monitor's work, not on the browser's: the suite's
# five test processes, trainings and vLLM servers share two cores, and one page may wait on work
# that costs the monitor several CPU seconds (the rollout's Parquet link imports transformers and
# datasets in the monitor process: 8 CPU s on a quiet machine). A fresh clone met 30 s on the
# Parquet download under that load; an answer that never comes still fails, later. (A page that
# never went network-idle met 180 s too: its tour waits for the page's load instead,
# test_dashboard_browser.py.)
TIMEOUT_MS = 180_000


def chromium_path() -> str:
    path = shutil.which("chromium")
    if not path:
        pytest.fail(
            "Debian's chromium is not installed; `make test` installs it (apt-get install chromium)"
        )
    return path


class Browser:
    """One Chromium with a fresh profile; records console errors and failed requests."""

    def __init__(self, user_data_dir):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        self.context = self._pw.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=chromium_path(),
            headless=True,
            args=BROWSER_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        self.context.set_default_timeout(TIMEOUT_MS)
        self.context.set_default_navigation_timeout(TIMEOUT_MS)
        self.page = self.context.pages[0] if self.context.pages else self.context.new_page()
        self.problems: list[str] = []
        self.page.on(
            "console",
            lambda m: (
                self.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None
            ),
        )
        self.page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.url}"))
        self.page.on(
            "response",
            lambda r: (
                self.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None
            ),
        )
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))

    def close(self) -> None:
        self.context.close()
        self._pw.stop()


def login(browser: Browser, base: str, token: str) -> None:
    page = browser.page
    page.goto(f"{base}/")
    assert "/login" in page.url
    page.fill("#token", token)
    with page.expect_navigation():
        page.click("button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "/login" not in page.url, page.content()[:2000]
