"""cua_rl/testing/fault_proxy.py over real loopback HTTP, in front of the local gym: answers pass
untouched, an armed drop cuts exactly one answer mid-way, a connection made before the upstream
is known waits for it."""

from __future__ import annotations

import threading

import httpx
import pytest

from cua_rl.sim.gym import GymServer
from cua_rl.testing.fault_proxy import FaultProxy


@pytest.fixture
def gym():
    with GymServer() as server:
        yield server


@pytest.fixture
def proxy():
    p = FaultProxy(wait_upstream_s=30.0).start()
    yield p
    p.stop()


def _upstream(gym) -> tuple[str, int]:
    host, port = gym.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_answers_pass_until_a_drop_cuts_one_mid_way(gym, proxy):
    proxy.set_upstream(*_upstream(gym))
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        direct = httpx.get(f"{gym.url}/api/v1/sim/tasks", timeout=10).json()
        assert client.get("/api/v1/sim/tasks").json() == direct
        proxy.drop_next(1)
        with pytest.raises(httpx.HTTPError):
            client.get("/api/v1/sim/tasks")
        assert proxy.dropped == 1
        # Only one answer was armed: the next call (a new connection) is whole again.
        assert client.get("/api/v1/sim/tasks").json() == direct
    assert proxy.dropped == 1


def test_a_connection_before_the_upstream_is_known_waits_for_it(gym, proxy):
    got: dict = {}

    def call() -> None:
        got["answer"] = httpx.get(f"{proxy.url}/healthz", timeout=30).json()

    caller = threading.Thread(target=call)
    caller.start()
    # The call cannot finish before the upstream is set: nothing else is listening.
    caller.join(0.5)
    assert "answer" not in got
    proxy.set_upstream(*_upstream(gym))
    caller.join(30)
    assert got["answer"]["ok"] is True
