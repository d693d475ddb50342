"""Bounded waits and OpenAI fidelity against a stand-in model server (faults staged by
construction: a pause the test holds, a server that aborts everything, an answer held back)."""

from __future__ import annotations

import asyncio
import threading

import httpx

from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.requests import token_bytes
from cua_rl.serving import ThreadedServer
from cua_rl.testing.fault_proxy import FaultProxy
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, user


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_a_server_that_aborts_everything_is_asked_a_bounded_number_of_times(
    standin_episode,
):
    standin = ModelStandIn(mode="abort")
    gw, episode, url, _ = standin_episode(standin, max_aborts=3)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    assert r.status_code == 502 and _error(r)["code"] == "abort_loop"
    assert standin.calls == 3
    assert [e.code for e in gw.close(episode).errors] == ["abort_loop"]


async def test_a_pause_past_its_bound_fails_the_call_and_says_how_long_it_waited(
    standin_episode,
):
    standin = ModelStandIn()
    gw, episode, url, engine = standin_episode(standin, max_pause_wait_s=0.3)
    engine.paused.set()  # never cleared: only the bound ends the wait
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    err = _error(r)
    assert r.status_code == 503 and err["code"] == "pause_timeout"
    assert "max_pause_wait_s=0.3" in err["message"] and "paused" in err["message"]
    assert standin.calls == 0
    assert [e.code for e in gw.close(episode).errors] == ["pause_timeout"]


async def test_a_stream_opens_before_the_model_answers(standin_episode):
    hold = threading.Event()
    standin = ModelStandIn(hold=hold)
    gw, episode, url, _ = standin_episode(standin)
    body = {"messages": [user("x")], "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/chat/completions", json=body) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            # The model has not answered (it is held): the stream is open all the same.
            assert first.startswith(":") and not hold.is_set()
            hold.set()
            rest = [line async for line in lines]
    data = [line[6:] for line in rest if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) == 3
    assert len(gw.close(episode).turns) == 1


async def test_every_route_answers_the_openai_error_shape(standin_episode):
    gw, episode, url, _ = standin_episode(ModelStandIn())
    base = url.rsplit("/episodes/", 1)[0]
    async with httpx.AsyncClient(timeout=60) as http:
        unknown = await http.get(f"{base}/v1/nothing")
        wrong_method = await http.get(f"{url}/chat/completions")
        bad_n = await http.post(f"{url}/chat/completions", json={"messages": [], "n": "x"})
        models = (await http.get(f"{url}/models")).json()
        one = await http.get(f"{url}/models/policy")
        missing = await http.get(f"{url}/models/other")
    assert unknown.status_code == 404 and _error(unknown)["code"] == "not_found"
    assert wrong_method.status_code == 405 and _error(wrong_method)
    assert bad_n.status_code == 400 and _error(bad_n)["code"] == "unsupported_n"
    (model,) = models["data"]
    assert model["id"] == "policy" and isinstance(model["created"], int) and model["created"] > 0
    assert one.json() == model
    assert missing.status_code == 404 and _error(missing)["code"] == "model_not_found"
    gw.close(episode)


def test_token_bytes_are_each_token_s_own_bytes(bpe_processor):
    tokenizer = bpe_processor.tokenizer
    text = "é漢 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes(tokenizer, t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    # At least one token is part of a UTF-8 sequence: its bytes are not a decodable string.
    assert any(_not_utf8(p) for p in pieces)


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


async def test_tools_are_refused_where_the_template_writes_none(standin_episode):
    # The tiny Qwen2-VL's template (the ChatML frame only) renders no tools: refused, never
    # answered as if they were not there.
    standin = ModelStandIn()
    gw, episode, url, _ = standin_episode(standin)
    tool = {"type": "function", "function": {"name": "tap", "parameters": {"type": "object"}}}
    history = [
        user("x"),
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    async with httpx.AsyncClient(timeout=60) as http:
        with_tools = await http.post(
            f"{url}/chat/completions", json={"messages": [user("x")], "tools": [tool]}
        )
        tool_history = await http.post(f"{url}/chat/completions", json={"messages": history})
        plain = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    assert with_tools.status_code == tool_history.status_code == 400
    assert _error(with_tools)["code"] == _error(tool_history)["code"] == "tools_unsupported"
    assert plain.status_code == 200 and standin.calls == 1
    gw.close(episode)


def _proxied(bpe_processor, **config):
    """A stand-in model server behind a fault proxy, a gateway sending every call to the proxy,
    and an engine whose own server is a closed port (only the proxy can answer)."""
    standin = ModelStandIn()
    server = ThreadedServer(standin.app, name="model-standin").start()
    proxy = FaultProxy().start()
    proxy.set_upstream(server.host, server.port)
    gw = Gateway(GatewayConfig(model_server_url=proxy.url, **config)).start()
    engine = FakeEngine("127.0.0.1:1")
    spec = SessionSpec(engine, Sampling(max_new_tokens=8), bpe_processor, "p", TrajectoryConfig())
    return standin, server, proxy, gw, engine, gw.open("ep", spec)


async def _call(http: httpx.AsyncClient, url: str, text: str) -> httpx.Response:
    # A new text each time: the test counts the server's calls per request.
    return await http.post(f"{url}/chat/completions", json={"messages": [user(text)]})


async def test_model_server_url_sends_calls_through_a_proxy_that_may_cut_them(bpe_processor):
    """gateway.model_server_url: every call goes to the proxy, not the engine's choice; one answer
    cut mid-way is re-sent (a normal answer); an outage past gateway.model_outage_s fails the
    call (502) with how long it lasted, and the episode counts it."""
    standin, server, proxy, gw, engine, url = _proxied(bpe_processor, model_outage_s=1.0)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            assert (await _call(http, url, "a")).status_code == 200
            proxy.drop_next(1)
            assert (await _call(http, url, "b")).status_code == 200
            assert proxy.dropped == 1 and standin.calls == 3
            proxy.outage()  # never restored: the call outlasts gateway.model_outage_s
            r = await _call(http, url, "c")
            assert r.status_code == 502 and _error(r)["code"] == "model_server_error"
            assert "past gateway.model_outage_s=1" in _error(r)["message"]
        assert engine.chosen == 0
        capture = gw.close("ep")
        assert [e.code for e in capture.errors] == ["model_server_error"]
        stats = capture.stats()
        # Every cut answer was one re-send (b's one and c's, all of them).
        assert stats["gateway/outage_retries"] == proxy.dropped >= 3
        assert stats["gateway/outage_s"] >= 1.0
    finally:
        gw.stop()
        proxy.stop()
        server.stop()


async def test_a_call_is_held_through_a_model_server_outage_and_answered_after_it(bpe_processor):
    """Every answer is cut until the test restores the server: the agent's call waits (no 502),
    gets the answer sampled after the outage, and that answer is the one turn trained."""
    standin, server, proxy, gw, engine, url = _proxied(bpe_processor, model_outage_s=600.0)
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            proxy.outage()
            call = asyncio.create_task(_call(http, url, "a"))
            # The outage lasts until the gateway has re-sent twice (a bound guards a hang).
            for _ in range(600):
                if proxy.dropped >= 3 or call.done():
                    break
                await asyncio.sleep(0.05)
            assert not call.done() and proxy.dropped >= 3
            proxy.restore()
            r = await call
        assert r.status_code == 200
        capture = gw.close("ep")
        assert capture.errors == [] and len(capture.turns) == 1
        turn = capture.turns[0]
        assert r.json()["choices"][0]["message"]["content"] == turn.text
        assert standin.calls == proxy.dropped + 1  # the cut answers, then the one received
        assert turn.retries == proxy.dropped == capture.outage_retries
        assert capture.stats()["gateway/outage_retries"] == proxy.dropped
        assert 0 < turn.outage_s == capture.outage_s
    finally:
        gw.stop()
        proxy.stop()
        server.stop()
