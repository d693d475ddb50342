"""The screenshot store: preparation on the training side, upload rules over real HTTP, retention,
and the recorder's path from a turn's image to a stored, referenced screenshot."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import random

import httpx
import pytest
from PIL import Image

from cua_rl.monitor.protocol import ScreenshotError
from cua_rl.monitor.server.screenshots import ScreenshotStore, default_root
from cua_rl.monitor.server.store import MonitorStore
from cua_rl.monitor.worker.client import MonitorClient, MonitorClientConfig
from cua_rl.monitor.worker.context import MonitorContext
from cua_rl.monitor.worker.recorder import RolloutRecorder
from cua_rl.monitor.worker.uploader import prepare_screenshot

from .conftest import MonitorProcess, uid


def _png(width: int, height: int, *, noise: bool = False, colour=(30, 120, 200)) -> bytes:
    img = Image.new("RGB", (width, height), colour)
    if noise:  # incompressible pixels: a large file for its size
        rng = random.Random(width * height)
        img.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(width * height)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------- preparation


def test_prepare_downscales_the_long_edge_and_keeps_the_source_size():
    shot = prepare_screenshot(_png(1080, 2400))
    assert (shot.width, shot.height) == (461, 1024)  # 1080 * 1024 / 2400 = 460.8
    assert (shot.source_width, shot.source_height) == (1080, 2400)
    assert shot.mime == "image/webp" and shot.data[8:12] == b"WEBP"
    assert shot.sha256 == _sha(shot.data) and shot.uri == f"sha256:{shot.sha256}"
    assert Image.open(io.BytesIO(shot.data)).size == (461, 1024)


def test_prepare_leaves_a_small_image_its_size_and_refuses_a_non_image():
    shot = prepare_screenshot(_png(360, 640))
    assert (shot.width, shot.height) == (360, 640) == (shot.source_width, shot.source_height)
    with pytest.raises(ScreenshotError) as err:
        prepare_screenshot(b"<html>not an image</html>")
    assert err.value.code == "not_an_image"


# ---------------------------------------------------------------------------- the HTTP store


@pytest.fixture(scope="module")
def shot_server(tmp_path_factory):
    proc = MonitorProcess(
        tmp_path_factory.mktemp("shots") / "shots.db",
        extra_args=("--screenshot-max-bytes", str(64 * 1024)),
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def http(shot_server):
    with httpx.Client(base_url=shot_server.base_url, timeout=30) as client:
        yield client


def _put(http, server, data: bytes, name: str | None = None, **headers):
    return http.put(
        f"/api/screenshots/{name or _sha(data)}",
        content=data,
        headers={**server.headers(), "Content-Type": "image/png", **headers},
    )


def test_a_non_image_is_refused(http, shot_server):
    body = b"GIF89a-but-not-really" + os.urandom(64)
    resp = _put(http, shot_server, body)
    assert resp.status_code == 415, resp.text
    assert resp.json()["error"]["code"] == "unsupported_media_type"
    # PNG magic bytes followed by garbage: refused after the decode check too.
    fake = b"\x89PNG\r\n\x1a\n" + os.urandom(200)
    assert _put(http, shot_server, fake).status_code == 415


def test_an_oversized_body_is_refused(http, shot_server):
    big = _png(200, 200, noise=True)
    assert len(big) > 64 * 1024
    resp = _put(http, shot_server, big)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["details"]["limit"] == 64 * 1024
    assert (
        http.get(f"/api/screenshots/{_sha(big)}", headers=shot_server.headers()).status_code == 404
    )


def test_a_hash_that_does_not_match_the_bytes_is_refused(http, shot_server):
    data = _png(20, 30)
    other = _sha(b"something else")
    resp = _put(http, shot_server, data, name=other)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["code"] == "hash_mismatch"
    assert http.get(f"/api/screenshots/{other}", headers=shot_server.headers()).status_code == 404
    # A name that is not a SHA-256 at all.
    assert _put(http, shot_server, data, name="abc").status_code == 422


def test_the_same_image_twice_is_stored_once(http, shot_server):
    data = _png(32, 48, colour=(1, 2, 3))
    first, second = _put(http, shot_server, data), _put(http, shot_server, data)
    assert (first.status_code, first.json()["created"]) == (201, True)
    assert (second.status_code, second.json()["created"]) == (200, False)
    root = default_root(shot_server.db)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert [p.name for p in files].count(_sha(data)) == 1
    import sqlite3

    con = sqlite3.connect(shot_server.db)
    assert (
        con.execute("SELECT COUNT(*) FROM screenshot WHERE sha256 = ?", (_sha(data),)).fetchone()[0]
        == 1
    )
    con.close()
    got = http.get(f"/api/screenshots/{_sha(data)}", headers=shot_server.headers())
    assert got.status_code == 200 and got.content == data
    assert got.headers["content-type"] == "image/png"


def test_image_reads_and_writes_need_the_token(http, shot_server):
    data = _png(10, 10, colour=(9, 9, 9))
    assert _put(http, shot_server, data).status_code == 201
    url = f"/api/screenshots/{_sha(data)}"
    assert http.get(url).status_code == 401
    assert http.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    no_token = http.put(url, content=data, headers={"Content-Type": "image/png"})
    assert no_token.status_code == 401


# ---------------------------------------------------------------------------- retention


def test_retention_drops_the_oldest_images_first(tmp_path):
    db = tmp_path / "m.db"
    MonitorStore(db).close()
    images = [_png(40, 40, noise=True) for _ in range(1)] + [
        _png(40 + i, 40, noise=True) for i in range(1, 4)
    ]
    size = max(len(i) for i in images)
    store = ScreenshotStore(db, max_image_bytes=size, max_total_bytes=2 * size + size // 2)
    for n, data in enumerate(images):
        store.put(_sha(data), data, now=f"2026-01-01 00:00:0{n}")
    assert store.total_bytes <= 2 * size + size // 2
    kept = [store.get(_sha(d)) is not None for d in images]
    assert kept == [False, False, True, True]
    assert not store.path_of(_sha(images[0])).exists()
    store.close()
    # A reopened store knows what it holds.
    again = ScreenshotStore(db, max_image_bytes=size, max_total_bytes=10 * size)
    assert again.stats()["images"] == 2 and again.total_bytes == len(images[2]) + len(images[3])
    again.close()


# ---------------------------------------------------------------------------- recorder path


async def test_recorder_uploads_each_turn_screenshot_and_references_it(shot_server):
    big = _png(1080, 2400)
    data_url = "data:image/png;base64," + base64.b64encode(big).decode()
    cfg = MonitorClientConfig(
        base_url=shot_server.base_url,
        token=shot_server.token,
        spool_path=str(shot_server.db.with_name(uid("spool-") + ".jsonl")),
    )
    run = uid("run-")
    fetched: list[str] = []

    async def fetch(url: str) -> bytes:
        fetched.append(url)
        return _png(100, 200, colour=(200, 10, 10))

    async with MonitorClient(cfg) as client:
        client.training(run, log_path="l", model_name="m")
        step = client.step(run, 1)
        rec = RolloutRecorder(
            client, uid("r-"), task_id=uid("t-"), model_path="m", source=MonitorContext(run, step)
        )
        await rec.start()
        await rec.screenshot(1, 0, data_url)
        await rec.screenshot(2, 0, "https://shots.example/expiring.png", fetch=fetch)
        await rec.screenshot(3, 0, "data:image/png;base64,bm90IGFuIGltYWdl")  # not an image
        await rec.screenshot(4, 0, "https://shots.example/no-fetch.png")
        await rec.complete(reward=1.0)
        assert await client.flush(timeout=30)
        assert client.screenshots.counters.uploaded == 2, client.screenshots.counters
    assert fetched == ["https://shots.example/expiring.png"]

    headers = shot_server.headers()
    with httpx.Client(base_url=shot_server.base_url, headers=headers, timeout=30) as http:
        rid = http.get("/api/trainings").json()["trainings"]
        tid = next(t["id"] for t in rid if t["run_name"] == run)
        steps = http.get(f"/api/trainings/{tid}").json()["training"]["steps"]
        rollouts = http.get(f"/api/steps/{steps[0]['id']}/rollouts").json()["rollouts"]
        turns = http.get(f"/api/rollouts/{rollouts[0]['id']}").json()["rollout"]["turns"]
        obs = {t["turn"]: t["observations"][0] for t in turns}
        first = obs[1]
        assert first["screenshot_uri"].startswith("sha256:")
        assert first["extra"]["source_width"] == 1080 and first["extra"]["source_height"] == 2400
        assert first["extra"]["source_url"] == f"data-url:{len(data_url)}B"
        img = http.get(f"/api/screenshots/{first['screenshot_uri'][7:]}")
        assert img.status_code == 200
        assert Image.open(io.BytesIO(img.content)).size == (461, 1024)
        assert obs[2]["screenshot_uri"].startswith("sha256:")
        assert obs[2]["extra"]["source_url"] == "https://shots.example/expiring.png"
        assert "screenshot_error" in obs[3]["extra"] and not obs[3].get("screenshot_uri")
        assert obs[4]["screenshot_uri"] == "https://shots.example/no-fetch.png"
