"""Gateway fixtures: a real vLLM CPU server (cua-rl's module), a gateway on loopback, and a
hand-written stand-in for AReaL's engine with the reads the gateway makes."""

from __future__ import annotations

import base64
import io
import threading

import pytest
from PIL import Image as PILImage

from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.weight_pauses import WeightPauses
from cua_rl.serving import ThreadedServer
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory import captured
from cua_rl.trajectory.config import TrajectoryConfig


class FakeEngine:
    """Version, pause flag and server choice, settable from the test; its pauses are measured
    by the gateway's own record (``cua_rl.gateway.weight_pauses``)."""

    def __init__(self, address: str, version: int = 0):
        self.address = address
        self.version = version
        self.paused = threading.Event()
        self.chosen = 0
        self.waited = threading.Event()  # a call found the rollout paused
        self.pauses = WeightPauses()

    def get_version(self) -> int:
        return self.version

    def is_paused(self) -> bool:
        if self.paused.is_set():
            self.waited.set()
            return True
        return False

    def choose_server(self) -> str:
        self.chosen += 1
        return self.address


def server_address(server) -> str:
    return f"{server.host}:{server.port}"


def png(color=(30, 120, 200), size=(96, 64)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def user(text: str, url: str | None = None) -> dict:
    parts: list[dict] = [{"type": "text", "text": text}]
    if url:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "user", "content": parts}


def row_of(capture, processor, trained_turns: int) -> dict:
    """The training row of a capture (every turn trained, nothing rejected)."""
    from cua_rl.trajectory import convert_turns

    res = convert_turns(
        captured.row_turns(capture, []),
        processor=processor,
        reward=1.0,
        version=0,
        fetched_images=captured.images(capture),
    )
    assert res.row is not None, res.reason
    assert res.stats["trained_turns"] == trained_turns
    return res.row


@pytest.fixture(scope="module")
def bpe_processor(tiny_vl_bpe_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)


@pytest.fixture(scope="module")
def gateway():
    gw = Gateway(GatewayConfig()).start()
    yield gw
    gw.stop()


@pytest.fixture
def open_episode(gateway, bpe_processor, vllm_bpe_server):
    """open_episode(**spec changes) -> (episode id, base URL, engine); closed at teardown."""
    opened: list[str] = []

    def make(
        name: str = "ep",
        sampling: Sampling | None = None,
        images: TrajectoryConfig | None = None,
        engine: FakeEngine | None = None,
        gw: Gateway | None = None,
    ):
        gw = gw or gateway
        episode = f"{name}-{len(opened)}-{id(gw)}"
        engine = engine or FakeEngine(server_address(vllm_bpe_server))
        spec = SessionSpec(
            engine,
            sampling or Sampling(temperature=1.0, max_new_tokens=16),
            bpe_processor,
            vllm_bpe_server.model,
            images or TrajectoryConfig(),
        )
        url = gw.open(episode, spec)
        opened.append((gw, episode))
        return episode, url, engine

    yield make
    for gw, episode in opened:
        if gw._lookup(episode) is not None:
            gw.close(episode)


@pytest.fixture
def standin_episode(bpe_processor):
    """standin_episode(standin, **config) -> (gateway, episode id, url, engine)."""
    started: list[tuple[Gateway, ThreadedServer]] = []

    def make(standin: ModelStandIn, **config):
        server = ThreadedServer(standin.app, name="model-standin").start()
        gw = Gateway(GatewayConfig(**config)).start()
        started.append((gw, server))
        engine = FakeEngine(f"{server.host}:{server.port}")
        spec = SessionSpec(
            engine, Sampling(max_new_tokens=8), bpe_processor, "policy", TrajectoryConfig()
        )
        return gw, "ep", gw.open("ep", spec), engine

    yield make
    for gw, server in started:
        gw.stop()
        server.stop()
