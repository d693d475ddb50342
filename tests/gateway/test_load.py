"""The gateway under many episodes and re-signed screenshots, against a stand-in model server."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import httpx
import pytest
from fastapi import FastAPI, Response

from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.serving import ThreadedServer
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory import captured
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, png, user

HTTP_IMAGES = TrajectoryConfig(allow_http=True, allowed_image_hosts=("127.0.0.1",))


@pytest.fixture
def image_host():
    """Screenshot n at /shots/n.png (any query string), counting the GETs."""
    app = FastAPI()
    app.state.hits = 0

    @app.get("/shots/{n}.png")
    def shot(n: int):
        app.state.hits += 1
        return Response(png((20 * n, 100, 50)), media_type="image/png")

    with ThreadedServer(app, name="images") as server:
        server.app = app
        yield server


@pytest.fixture
def served(bpe_processor):
    """served(standin, config, sampling) -> (gateway, engine); stopped at teardown."""
    started = []

    def make(standin, config=None, sampling=None, images=HTTP_IMAGES):
        server = ThreadedServer(standin.app, name="model-standin").start()
        gw = Gateway(config or GatewayConfig()).start()
        started.append((gw, server))
        engine = FakeEngine(f"{server.host}:{server.port}")
        spec = SessionSpec(
            engine, sampling or Sampling(max_new_tokens=4), bpe_processor, "policy", images
        )
        return gw, spec

    yield make
    for gw, server in started:
        gw.stop()
        server.stop()


def resigned(base: str, n: int, turn: int) -> str:
    return f"{base}/shots/{n}.png?X-Amz-Expires=60&X-Amz-Signature=s{turn}n{n}&w=1"


async def test_re_signed_screenshots_are_fetched_once_each_and_held_once(served, image_host):
    gw, spec = served(ModelStandIn())
    url = gw.open("ep", spec)
    messages: list[dict] = []
    async with httpx.AsyncClient(timeout=60) as http:
        for turn in range(10):
            # Every turn the agent re-signs every screenshot of its history.
            history, n = [], 0
            for m in messages:
                if m["role"] == "user":
                    m, n = user(f"step {n}", resigned(image_host.url, n, turn)), n + 1
                history.append(m)
            messages = [*history, user(f"step {turn}", resigned(image_host.url, turn, turn))]
            r = await http.post(f"{url}/chat/completions", json={"messages": messages})
            assert r.status_code == 200, r.text
            messages.append(r.json()["choices"][0]["message"])
    capture = gw.close("ep")
    assert image_host.app.state.hits == 10
    assert capture.stats()["gateway/image_fetches"] == 10
    last = capture.turns[-1].images
    assert len(last) == 10
    # One copy of each screenshot's bytes, shared by every turn that shows it.
    assert all(last[n] is capture.turns[n].images[n] for n in range(10))
    assert len(captured.images(capture)) == 10


async def test_image_fetches_go_through_while_200_generations_are_in_flight(served, image_host):
    hold = threading.Event()
    standin = ModelStandIn(hold=hold)
    gw, spec = served(standin, GatewayConfig(max_connections=201))
    urls = [gw.open(f"ep{i}", spec) for i in range(201)]
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        held = [
            asyncio.create_task(http.post(f"{u}/chat/completions", json={"messages": [user("x")]}))
            for u in urls[:200]
        ]
        await asyncio.to_thread(standin.wait_calls, 200)
        shot = f"{image_host.url}/shots/1.png"
        late = asyncio.create_task(
            http.post(f"{urls[200]}/chat/completions", json={"messages": [user("x", shot)]})
        )
        # Its generation reaches the server only after its image was fetched.
        await asyncio.to_thread(standin.wait_calls, 201)
        hold.set()
        answers = await asyncio.gather(*held, late)
    assert [r.status_code for r in answers] == [200] * 201
    assert image_host.app.state.hits == 1
    for i in range(201):
        gw.close(f"ep{i}")


async def test_max_tokens_caps_each_turn_as_areal_does(served):
    standin = ModelStandIn(output_ids=tuple(range(40, 60)))
    gw, spec = served(standin, sampling=Sampling(max_new_tokens=16))
    url = gw.open("free", spec)
    async with httpx.AsyncClient(timeout=60) as http:
        await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
        prompt_len = len(standin.last["token_ids"])
        assert standin.last["sampling_params"]["max_tokens"] == 16
        gw.close("free")
        capped = replace(spec, sampling=Sampling(max_new_tokens=16, max_tokens=prompt_len + 5))
        url = gw.open("capped", capped)
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
        assert r.status_code == 200
        assert standin.last["sampling_params"]["max_tokens"] == 5
        assert r.json()["usage"]["completion_tokens"] == 5
        gw.close("capped")
        full = replace(spec, sampling=Sampling(max_new_tokens=16, max_tokens=prompt_len))
        url = gw.open("full", full)
        calls = standin.calls
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert standin.calls == calls
    gw.close("full")
