"""Image fetch policy: refused hosts never see a request; size, time and status limits hold.

Contract tests fetch over real HTTP from a loopback server started by a fixture; faults
(slow or failing transports) are injected with ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import http.server
import threading

import httpx
import pytest

from cua_rl.errors import ConfigError, RejectedEpisode
from cua_rl.trajectory import TrajectoryConfig, check_image_url, fetch_images, load_images

from .conftest import png_data_url, solid_png

PNG = solid_png(64, 48, (9, 99, 199))


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        type(self).hits.append(self.path)
        if self.path == "/shot.png":
            body, status = PNG, 200
        elif self.path == "/big.png":
            body, status = PNG + b"\0" * 5000, 200
        else:
            body, status = b"gone", 404
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    _Handler.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", _Handler.hits
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def _cfg(**kw):
    kw.setdefault("allowed_image_hosts", ("127.0.0.1",))
    kw.setdefault("allow_http", True)
    return TrajectoryConfig(**kw)


async def test_fetch_from_allowed_host(image_server):
    base, hits = image_server
    urls = [f"{base}/shot.png", png_data_url(PNG), f"{base}/shot.png"]
    fetched = await fetch_images(urls, _cfg())
    assert fetched == {f"{base}/shot.png": PNG}
    assert hits == ["/shot.png"]  # once, data URL not fetched
    imgs = load_images(urls, fetched, _cfg())
    assert [im.size for im in imgs] == [(64, 48)] * 3


@pytest.mark.parametrize(
    "cfg_kw, url",
    [
        ({"allowed_image_hosts": ("screens.example.com",)}, "{base}/shot.png"),
        ({"allow_http": False}, "{base}/shot.png"),  # http refused when only https allowed
        ({}, "file:///etc/passwd"),
        ({}, "ftp://127.0.0.1/shot.png"),
    ],
)
async def test_refused_before_any_fetch(image_server, cfg_kw, url):
    base, hits = image_server
    good = f"{base}/shot.png"
    with pytest.raises(RejectedEpisode) as exc:
        # The refused URL comes after an allowed one: nothing may be fetched at all.
        await fetch_images([good, url.format(base=base)], _cfg(**cfg_kw))
    assert exc.value.reason == "image_url_refused"
    assert hits == []


async def test_size_limit(image_server):
    base, _ = image_server
    with pytest.raises(RejectedEpisode) as exc:
        await fetch_images([f"{base}/big.png"], _cfg(max_image_bytes=len(PNG) + 100))
    assert exc.value.reason == "image_too_large"


async def test_http_error_status(image_server):
    base, _ = image_server
    with pytest.raises(RejectedEpisode) as exc:
        await fetch_images([f"{base}/missing.png"], _cfg())
    assert exc.value.reason == "image_fetch_failed"
    assert "404" in exc.value.detail


async def test_timeout_injected():
    async def slow(request):
        await asyncio.sleep(5)
        return httpx.Response(200, content=PNG)

    cfg = _cfg(allowed_image_hosts=("screens.example.com",), image_fetch_timeout_s=0.2)
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as client:
        with pytest.raises(RejectedEpisode) as exc:
            await fetch_images(["https://screens.example.com/a.png"], cfg, client=client)
    assert exc.value.reason == "image_fetch_timeout"


async def test_connection_drop_injected():
    def drop(request):
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    cfg = _cfg(allowed_image_hosts=("screens.example.com",))
    async with httpx.AsyncClient(transport=httpx.MockTransport(drop)) as client:
        with pytest.raises(RejectedEpisode) as exc:
            await fetch_images(["https://screens.example.com/a.png"], cfg, client=client)
    assert exc.value.reason == "image_fetch_failed"


def test_load_images_is_offline():
    cfg = _cfg(allowed_image_hosts=("screens.example.com",))
    with pytest.raises(RejectedEpisode) as exc:
        load_images(["https://screens.example.com/a.png"], {}, cfg)
    assert exc.value.reason == "image_not_fetched"


def test_data_url_size_limit():
    with pytest.raises(RejectedEpisode) as exc:
        load_images([png_data_url(PNG)], {}, _cfg(max_image_bytes=10))
    assert exc.value.reason == "image_too_large"


def test_check_image_url_kinds():
    cfg = _cfg(allowed_image_hosts=("Screens.Example.com",), allow_http=False)
    assert check_image_url("data:image/png;base64,AAAA", cfg) == "data"
    assert check_image_url("https://screens.example.com:8443/x.png", cfg) == "http"


@pytest.mark.parametrize(
    "kw",
    [
        {"allowed_image_hosts": ("https://x.com",)},
        {"allowed_image_hosts": ("x.com:443",)},
        {"allowed_image_hosts": ("*.x.com",)},
        {"max_image_bytes": 0},
        {"image_fetch_timeout_s": 0},
        {"prefix_break_policy": "stitch"},
        {"missing_tokens_policy": "zeros"},
    ],
)
def test_config_validation(kw):
    with pytest.raises(ConfigError):
        TrajectoryConfig(**kw)
