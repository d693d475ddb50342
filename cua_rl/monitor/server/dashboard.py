"""The dashboard: server-rendered pages over the monitor database, next to the API.

Pages are Jinja2 templates (``templates/``) filled from :mod:`cua_rl.monitor.server.views`; the only
client-side code is ``static/dashboard.js`` (live refresh, charts) and the vendored uPlot
(``static/uPlot.*``, MIT, its licence beside it), so nothing is built on the user's machine and
nothing is loaded from another host at run time (a Content-Security-Policy says so to the
browser).

Live updates without a reload: a page whose subject is still running polls its own URL with
``X-Live: 1`` every few seconds; the page swaps in every element marked ``data-live`` whose
HTML changed and gives the charts their new data. Each page answer carries
``Server-Timing: render;dur=<ms>`` (queries plus template), which the bench reads.

Auth (when the server has a token): the login form posts the token once and gets an HttpOnly,
SameSite=Strict session cookie derived from the token by HMAC (no server-side state; changing
the token ends every session). Pages, static files and image reads accept that cookie or
``Authorization: Bearer <token>``; writes (ingest, image upload) take only the Bearer token, so a
cookie can never be used to write from another site.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from jinja2 import Environment, FileSystemLoader, select_autoescape

from cua_rl.monitor.protocol import SOURCE_TYPES
from cua_rl.monitor.server import views
from cua_rl.monitor.server.read import MonitorReader
from cua_rl.monitor.server.screenshots import default_root
from cua_rl.monitor.server.views import parse_time

HERE = Path(__file__).parent
STATIC = HERE / "static"
SESSION_COOKIE = "cua_monitor_session"
DEFAULT_STALE_AFTER_S = 300.0
DEFAULT_REFRESH_S = 3.0
# The browser may load scripts, styles and images from this server only.
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; form-action 'self'"
)


class DashboardAuth:
    """Token checks for the API and the pages; ``token=None`` leaves everything open."""

    def __init__(self, token: str | None):
        self.token = token
        self._bearer = f"Bearer {token}".encode() if token else None
        self.session = (
            hmac.new(token.encode(), b"cua-rl dashboard session v1", hashlib.sha256).hexdigest()
            if token
            else None
        )

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def bearer(self, request: Request) -> str | None:
        """None when allowed; else why not ("missing" or "wrong")."""
        if self._bearer is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if not given:
            return "missing"
        return None if hmac.compare_digest(given, self._bearer) else "wrong"

    def reader(self, request: Request) -> str | None:
        """Reads also accept the session cookie."""
        if self._bearer is None:
            return None
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie and hmac.compare_digest(cookie.encode(), self.session.encode()):
            return None
        return self.bearer(request)

    def token_ok(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())


def _fmt_num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "–"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.{digits - 1}e}"
        text = f"{value:,.{digits}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return str(value)


def _fmt_pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.0f}%"


def _span(s: int) -> str:
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d"


def _fmt_age(seconds: Any) -> str:
    if seconds is None:
        return "never"
    return f"{int(seconds)}s ago" if seconds < 60 else f"{_span(int(seconds))} ago"


def _fmt_duration(seconds: Any) -> str:
    if seconds is None:
        return "–"
    return f"{float(seconds):.1f}s" if seconds < 60 else _span(int(seconds))


def _fmt_when(value: Any) -> str:
    """Every timestamp of the pages in one form, to the second, UTC (the database keeps some to
    the microsecond, some to the millisecond, some as ISO with a T); the value as stored stays in
    a template's ``title``."""
    parsed = parse_time(value)
    if parsed is None:
        return "–" if not value else str(value)
    return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _fmt_model_name(path: Any) -> str:
    """A model's name for a narrow column: a local checkpoint's folder name (cutting a long path
    at its start left a fragment such as ``t/i55/.cache/...``), a hub id (``org/name``) whole.
    The full path is the column's ``title`` and is shown whole on the training's page."""
    if not path:
        return "–"
    text = str(path).rstrip("/")
    if text.startswith(("/", ".", "~")):
        return text.rsplit("/", 1)[-1] or text
    return text


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(("html",)),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _fmt_num
    env.filters["pct"] = _fmt_pct
    env.filters["age"] = _fmt_age
    env.filters["duration"] = _fmt_duration
    env.filters["when"] = _fmt_when
    env.filters["model_name"] = _fmt_model_name
    return env


def _safe_next(value: str | None) -> str:
    """Only a local path: the login form must not redirect to another site."""
    if not value or not value.startswith("/") or value.startswith("//"):
        return "/"
    parts = urlsplit(value)
    return parts.path + (f"?{parts.query}" if parts.query else "")


class _Pages:
    """What every page route shares: the templates, the auth guard and the timed render."""

    def __init__(self, auth: DashboardAuth, refresh_s: float):
        self.env = _environment()
        self.auth = auth
        self.refresh_s = refresh_s

    @staticmethod
    def html(body: str, status: int = 200, headers: dict | None = None) -> HTMLResponse:
        return HTMLResponse(
            body,
            status_code=status,
            headers={
                "Content-Security-Policy": CSP,
                "Cache-Control": "no-store",
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "same-origin",
                **(headers or {}),
            },
        )

    def login_page(
        self, request: Request, error: str | None = None, status: int = 200, nxt: str | None = None
    ) -> Response:
        nxt = nxt or _safe_next(request.query_params.get("next"))
        body = self.env.get_template("login.html").render(error=error, next=nxt)
        return self.html(body, status)

    def guard(self, request: Request) -> Response | None:
        why = self.auth.reader(request)
        if why is None:
            return None
        if request.headers.get("x-live") or why == "wrong":
            # A script's poll, or a wrong Bearer token: an answer, not a redirect.
            return self.login_page(request, "wrong token" if why == "wrong" else None, 401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)

    async def render(
        self, request: Request, template: str, build: Callable[[], dict | None], title: str
    ) -> Response:
        denied = self.guard(request)
        if denied is not None:
            return denied

        def work() -> tuple[str | None, float]:
            t0 = time.perf_counter()
            ctx = build()
            if ctx is None:
                return None, (time.perf_counter() - t0) * 1000
            out = self.env.get_template(template).render(
                **ctx,
                title=title,
                auth_on=self.auth.enabled,
                refresh_ms=int(self.refresh_s * 1000),
                path=request.url.path,
            )
            return out, (time.perf_counter() - t0) * 1000

        body, ms = await anyio.to_thread.run_sync(work)
        timing = {"Server-Timing": f"render;dur={ms:.2f}"}
        if body is None:
            page = self.env.get_template("not_found.html").render(
                title="Not found", auth_on=self.auth.enabled
            )
            return self.html(page, 404, timing)
        return self.html(body, 200, timing)


def install_dashboard(
    app: FastAPI,
    db_path: str | Path,
    auth: DashboardAuth,
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    refresh_s: float = DEFAULT_REFRESH_S,
    screenshots_root: str | Path | None = None,
) -> None:
    """Add the login, page and static routes to ``app`` (the API's app); the rollout page's
    export reads the images from ``screenshots_root`` (default: beside the database)."""
    pages = _Pages(auth, refresh_s)
    read = MonitorReader(Path(db_path))
    app.router.on_shutdown.append(read.close)
    _install_login(app, pages)
    _install_training_pages(app, pages, read, stale_after_s)
    _install_rollout_pages(app, pages, read)
    _install_audit_pages(app, pages, read)
    shots = Path(screenshots_root) if screenshots_root else default_root(Path(db_path))
    _install_rollout_export(app, pages, read, shots)
    _install_static(app, pages)


def _install_login(app: FastAPI, pages: _Pages) -> None:
    auth = pages.auth

    @app.get("/login")
    async def login_form(request: Request):
        if auth.reader(request) is None:
            return RedirectResponse(_safe_next(request.query_params.get("next")), status_code=303)
        return pages.login_page(request)

    @app.post("/login")
    async def login(request: Request):
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > 8192:  # a token form is a few hundred bytes
                return pages.login_page(request, "request too large", 413)
        form = parse_qs(raw.decode(errors="replace"))
        token = (form.get("token") or [""])[0].strip()
        nxt = _safe_next((form.get("next") or ["/"])[0])
        if not auth.enabled:
            return RedirectResponse(nxt, status_code=303)
        if not auth.token_ok(token):
            return pages.login_page(request, "wrong token", 401, nxt)
        resp = RedirectResponse(nxt, status_code=303)
        resp.set_cookie(
            SESSION_COOKIE,
            auth.session,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        return resp

    @app.post("/logout")
    async def logout(request: Request):
        resp = RedirectResponse("/login", status_code=303)
        resp.delete_cookie(SESSION_COOKIE, path="/")
        return resp


def _now() -> datetime:
    return datetime.now(UTC)


def _install_training_pages(
    app: FastAPI, pages: _Pages, read: MonitorReader, stale_after_s: float
) -> None:
    @app.get("/")
    async def trainings_index(request: Request):
        return await pages.render(
            request,
            "trainings.html",
            lambda: views.trainings_page(read, now=_now(), stale_after_s=stale_after_s),
            "Trainings",
        )

    @app.get("/trainings/{training_id}")
    async def training_detail(request: Request, training_id: int):
        def build():
            ctx = views.training_page(read, training_id, now=_now(), stale_after_s=stale_after_s)
            if ctx is not None:
                ctx["history"] = views.status_history(read, "training", training_id)
            return ctx

        return await pages.render(request, "training.html", build, f"Training {training_id}")


def _install_rollout_pages(app: FastAPI, pages: _Pages, read: MonitorReader) -> None:
    def make(kind: str):
        async def source_detail(request: Request, source_id: int):
            def build():
                ctx = views.source_page(read, kind, source_id)
                if ctx is not None:
                    ctx["history"] = views.status_history(read, kind, source_id)
                return ctx

            return await pages.render(request, "source.html", build, f"{kind.title()} {source_id}")

        return source_detail

    for kind in SOURCE_TYPES:
        app.add_api_route(f"/{kind}s/{{source_id}}", make(kind), methods=["GET"])

    @app.get("/rollouts/{rollout_id}")
    async def rollout_detail(request: Request, rollout_id: int):
        return await pages.render(
            request, "rollout.html", lambda: views.rollout_page(read, rollout_id), "Rollout"
        )


def _install_audit_pages(app: FastAPI, pages: _Pages, read: MonitorReader) -> None:
    """Verifier audits (``python -m cua_rl.audit``): the list and one audit's verdicts."""

    @app.get("/audits")
    async def audits_index(request: Request):
        return await pages.render(
            request, "audits.html", lambda: views.audits_page(read), "Verifier audits"
        )

    @app.get("/audits/{audit_id}")
    async def audit_detail(request: Request, audit_id: int):
        return await pages.render(
            request, "audit.html", lambda: views.audit_page(read, audit_id), f"Audit {audit_id}"
        )


def _install_rollout_export(app: FastAPI, pages: _Pages, read: MonitorReader, shots: Path) -> None:
    """The rollout page's export link: the records ``python -m cua_rl.monitor export`` writes
    for that rollout's stored episode, as one Parquet file."""

    @app.get("/rollouts/{rollout_id}/examples.parquet")
    async def rollout_examples(request: Request, rollout_id: int):
        denied = pages.guard(request)
        if denied is not None:
            return denied

        def build() -> tuple[bytes | None, str, int]:
            from cua_rl.monitor.export import ExportError, parquet_bytes, rollout_examples

            try:
                return parquet_bytes(rollout_examples(read.conn(), shots, rollout_id)), "", 200
            except ExportError as exc:
                return None, str(exc), 404
            except ImportError as exc:
                # A monitor served from a light install (pip install -e .): the export decodes
                # with transformers and writes with datasets, which only the extra brings.
                return None, export_missing(exc), 501

        data, why, status = await anyio.to_thread.run_sync(build)
        headers = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
        if data is None:
            return PlainTextResponse(f"no export: {why}\n", status_code=status, headers=headers)
        name = f"rollout-{rollout_id}-examples.parquet"
        headers["Content-Disposition"] = f'attachment; filename="{name}"'
        return Response(data, media_type="application/vnd.apache.parquet", headers=headers)


def export_missing(exc: ImportError) -> str:
    """What a monitor without the export's packages says instead of a server error."""
    name = exc.name or str(exc)
    return (
        f"this monitor's environment lacks {name}, which the export needs: install the "
        "monitor's export extra there (pip install -e '.[export]': datasets and transformers) "
        "and restart it, or export with python -m cua_rl.monitor export from the training's "
        "environment (docs/warehouse.md)"
    )


def _install_static(app: FastAPI, pages: _Pages) -> None:
    static_files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
    media = {".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}

    @app.get("/static/{name}")
    async def static(request: Request, name: str):
        denied = pages.guard(request)
        if denied is not None:
            return denied
        path = static_files.get(name)
        if path is None:
            return pages.html("not found", 404)
        return FileResponse(
            path,
            media_type=media.get(path.suffix, "application/octet-stream"),
            headers={"Cache-Control": "private, max-age=300", "X-Content-Type-Options": "nosniff"},
        )
