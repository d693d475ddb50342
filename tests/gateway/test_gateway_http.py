"""The gateway over real HTTP on loopback, sampling from a real vLLM CPU server."""

from __future__ import annotations

import asyncio
import io
import json
import os

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from PIL import Image as PILImage

from cua_rl.gateway import Gateway, GatewayConfig, Sampling
from cua_rl.serving import ThreadedServer
from cua_rl.testing.forward import load_vl_model, trained_gap
from cua_rl.trajectory import captured, convert_turns, split_segments
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, data_url, png, user

pytestmark = pytest.mark.slow


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


async def test_plain_request_gets_an_openai_answer_and_the_capture_has_exact_tokens(
    open_episode, gateway, vllm_bpe_server
):
    episode, url, engine = open_episode()
    messages = [{"role": "system", "content": "You operate a phone."}, user("Go", data_url(png()))]
    async with httpx.AsyncClient(timeout=120) as http:
        models = (await http.get(f"{url}/models")).json()
        r = await http.post(f"{url}/chat/completions", json={"model": "x", "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    # An unpatched agent asked for nothing: it gets no token data, yet the gateway has it all.
    assert "token_ids" not in choice and "prompt_token_ids" not in body
    assert choice["logprobs"] is None
    assert [m["id"] for m in models["data"]] == [
        open_episode.__self__ if False else models["data"][0]["id"]
    ]
    capture = gateway.close(episode)
    (turn,) = capture.turns
    assert turn.response_id == body["id"]
    assert body["usage"]["prompt_tokens"] == len(turn.prompt_ids)
    assert body["usage"]["completion_tokens"] == len(turn.output_ids) == len(turn.logprobs)
    assert all(lp <= 0 for lp in turn.logprobs)
    assert turn.versions == [0] * len(turn.output_ids)
    assert len(turn.images) == 1 and turn.images[0].data == png()
    assert engine.chosen == 1
    assert turn.overridden == {}


async def test_patched_agent_gets_token_data_in_vllm_s_shape(open_episode):
    _, url, _ = open_episode()
    req = {"messages": [user("Hi")], "logprobs": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{url}/chat/completions", json=req)
    body = r.json()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) > 0
    assert body["prompt_token_ids"] and all(isinstance(t, int) for t in body["prompt_token_ids"])


async def test_agent_sampling_is_recorded_and_replaced_by_the_trainer_s(open_episode, gateway):
    episode, url, _ = open_episode(sampling=Sampling(temperature=0.7, max_new_tokens=8))
    req = {"messages": [user("Hi")], "temperature": 0, "max_tokens": 200, "logit_bias": {"5": 9}}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{url}/chat/completions", json=req)
    assert r.status_code == 200, r.text
    (turn,) = gateway.close(episode).turns
    assert turn.asked == {"temperature": 0, "max_tokens": 200, "logit_bias": {"5": 9}}
    assert turn.overridden == turn.asked
    # The trainer's max_new_tokens (8) bounded the reply, not the agent's 200.
    assert len(turn.output_ids) <= 8


async def test_sampling_mismatch_can_be_an_error(open_episode, bpe_processor):
    gw = Gateway(GatewayConfig(sampling_mismatch="error")).start()
    try:
        _, url, _ = open_episode(gw=gw)
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(
                f"{url}/chat/completions", json={"messages": [user("Hi")], "temperature": 0}
            )
            same = await http.post(
                f"{url}/chat/completions", json={"messages": [user("Hi")], "temperature": 1.0}
            )
    finally:
        gw.stop()
    assert r.status_code == 400 and _error(r)["code"] == "sampling_mismatch"
    assert same.status_code == 200


async def test_stream_gets_the_whole_answer_as_server_sent_events(open_episode):
    _, url, _ = open_episode()
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(
            f"{url}/chat/completions", json={"messages": [user("Hi")], "stream": True}
        )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_bad_requests_get_openai_errors_and_nothing_is_left_open(open_episode, gateway):
    episode, url, _ = open_episode()
    base = url.split("/episodes/")[0]
    async with httpx.AsyncClient(timeout=60) as http:
        unknown = await http.post(f"{base}/episodes/nope/v1/chat/completions", json={})
        unknown_models = await http.get(f"{base}/episodes/nope/v1/models")
        bad_json = await http.post(
            f"{url}/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        not_object = await http.post(f"{url}/chat/completions", json=[1, 2])
        no_messages = await http.post(f"{url}/chat/completions", json={"messages": []})
        two = await http.post(f"{url}/chat/completions", json={"messages": [user("x")], "n": 2})
        audio = await http.post(
            f"{url}/chat/completions",
            json={"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        )
        not_image = await http.post(
            f"{url}/chat/completions",
            json={"messages": [user("x", "data:image/png;base64,aGVsbG8=")]},
        )
    assert unknown.status_code == 404 and _error(unknown)["code"] == "episode_not_found"
    assert unknown_models.status_code == 404
    assert bad_json.status_code == 400 and _error(bad_json)["code"] == "invalid_json"
    assert not_object.status_code == 400 and _error(not_object)["code"] == "invalid_json"
    assert no_messages.status_code == 400
    assert two.status_code == 400 and _error(two)["code"] == "unsupported_n"
    assert audio.status_code == 400
    assert not_image.status_code == 400
    capture = gateway.close(episode)
    assert capture.turns == []
    assert {e.code for e in capture.errors} >= {"unsupported_n", "invalid_image"}
    # A closed episode is gone: its agent gets 404 from then on.
    async with httpx.AsyncClient(timeout=60) as http:
        after = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    assert after.status_code == 404


async def test_body_over_the_limit_is_refused_with_413(open_episode):
    gw = Gateway(GatewayConfig(max_body_bytes=4096)).start()
    try:
        _, url, _ = open_episode(gw=gw)
        noise = PILImage.frombytes("RGB", (200, 200), os.urandom(200 * 200 * 3))
        buf = io.BytesIO()
        noise.save(buf, "PNG")
        big = {"messages": [user("x", data_url(buf.getvalue()))]}
        assert len(json.dumps(big)) > 4096
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{url}/chat/completions", json=big)
            # Chunked, no Content-Length: refused while reading.
            body = json.dumps(big).encode()

            async def chunks():
                for i in range(0, len(body), 1000):
                    yield body[i : i + 1000]

            chunked = await http.post(f"{url}/chat/completions", content=chunks())
    finally:
        gw.stop()
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    assert chunked.status_code == 413


@pytest.fixture
def image_host():
    """An HTTP server with one PNG that counts the requests it gets."""
    app = FastAPI()
    app.state.hits = 0

    @app.get("/shot.png")
    def shot():
        app.state.hits += 1
        return Response(png((1, 2, 3)), media_type="image/png")

    with ThreadedServer(app, name="images") as server:
        server.app = app
        yield server


async def test_image_hosts_are_checked_before_any_fetch(open_episode, image_host, gateway):
    shot = f"{image_host.url}/shot.png"
    refused, url, _ = open_episode(images=TrajectoryConfig(allow_http=True))
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x", shot)]})
    assert r.status_code == 400 and _error(r)["code"] == "image_url_refused"
    assert image_host.app.state.hits == 0
    assert [e.code for e in gateway.close(refused).errors] == ["image_url_refused"]

    allowed = TrajectoryConfig(allow_http=True, allowed_image_hosts=("127.0.0.1",))
    episode, url, _ = open_episode(images=allowed)
    msgs = [user("x", shot)]
    async with httpx.AsyncClient(timeout=120) as http:
        r1 = await http.post(f"{url}/chat/completions", json={"messages": msgs})
        msgs += [{"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]}]
        msgs += [user("again")]
        r2 = await http.post(f"{url}/chat/completions", json={"messages": msgs})
    assert r1.status_code == r2.status_code == 200
    # Fetched once per episode: the model and the row get the same bytes; URLs may expire.
    assert image_host.app.state.hits == 1
    capture = gateway.close(episode)
    assert capture.turns[1].images[0].data == png((1, 2, 3))


class DropFirst(httpx.AsyncBaseTransport):
    """Fault injection in front of the real server: the first ``n`` requests lose the connection."""

    def __init__(self, n: int):
        self.n = n
        self.real = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request):
        if self.n > 0:
            self.n -= 1
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        return await self.real.handle_async_request(request)


async def test_a_dropped_model_connection_is_re_sent_until_gateway_model_outage_s(open_episode):
    transport = DropFirst(1)
    gw = Gateway(
        GatewayConfig(model_outage_s=1.0),
        client_factory=lambda: httpx.AsyncClient(transport=transport),
    ).start()
    try:
        episode, url, _ = open_episode(gw=gw)
        async with httpx.AsyncClient(timeout=120) as http:
            ok = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
            transport.n = 5
            failed = await http.post(f"{url}/chat/completions", json={"messages": [user("y")]})
        capture = gw.close(episode)
    finally:
        gw.stop()
    assert ok.status_code == 200
    assert capture.turns[0].retries == 1
    assert failed.status_code == 502 and _error(failed)["code"] == "model_server_error"
    assert "past gateway.model_outage_s=1" in _error(failed)["message"]
    assert [e.code for e in capture.errors] == ["model_server_error"]
    # Re-sent (after 0.5 s, then at the deadline) before giving up; how many sends fit in the
    # second is the machine's speed, so the count is checked against the transport's own.
    cut = 5 - transport.n
    assert 2 <= cut <= 5 and capture.outage_retries == 1 + cut


async def test_calls_wait_while_the_rollout_is_paused(open_episode, gateway):
    episode, url, engine = open_episode()
    engine.paused.set()
    async with httpx.AsyncClient(timeout=120) as http:
        call = asyncio.create_task(
            http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
        )
        # The call found the rollout paused (by construction, not by waiting a while).
        await asyncio.to_thread(engine.waited.wait, 60)
        assert not call.done(), "a call during a weight update must wait for it"
        engine.version = 4
        engine.paused.clear()
        r = await call
    assert r.status_code == 200
    (turn,) = gateway.close(episode).turns
    assert turn.paused_s > 0
    # The server labels no version (no update reached it): the engine's version after the call.
    assert set(turn.versions) == {4}


class TornDownEngine(FakeEngine):
    def choose_server(self) -> str:
        raise IndexError("list index out of range")  # AReaL's engine after destroy()


async def test_a_torn_down_engine_answers_503_not_a_traceback(open_episode, gateway):
    episode, url, _ = open_episode(engine=TornDownEngine("unused:1"))
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("x")]})
    assert r.status_code == 503 and _error(r)["code"] == "engine_unavailable"
    assert [e.code for e in gateway.close(episode).errors] == ["engine_unavailable"]


async def test_an_agent_that_drops_its_oldest_screenshot_breaks_the_row_once(
    open_episode, gateway, bpe_processor
):
    """Four turns; at turn 3 the agent keeps only its latest screenshots (the first one becomes
    text), then goes on from that history: one new segment, one counted break, at turn 3."""
    episode, url, _ = open_episode()
    shots = [data_url(png((60 * i, 90, 200 - 40 * i))) for i in range(4)]
    messages: list[dict] = [{"role": "system", "content": "You operate a phone."}]
    async with httpx.AsyncClient(timeout=120) as http:
        for n, shot in enumerate(shots, start=1):
            if n == 3:
                messages[1] = user("Step 1 (screenshot dropped)")
            messages.append(user(f"Step {n}", shot))
            r = await http.post(
                f"{url}/chat/completions", json={"model": "x", "messages": messages}
            )
            assert r.status_code == 200, r.text
            messages.append(r.json()["choices"][0]["message"])
    capture = gateway.close(episode)
    assert [t.segment for t in capture.turns] == [1, 1, 2, 2]
    assert all(t.extended for t in capture.turns)  # the server expanded what was sent
    stats = capture.stats()
    assert stats["gateway/new_segments"] == 1 and stats["gateway/segments"] == 2
    turns = captured.row_turns(capture, [])
    segments, breaks = split_segments(turns)
    assert breaks == 1
    assert [[t.index for t in s.turns] for s in segments] == [[0, 1], [2, 3]]
    res = convert_turns(
        turns,
        processor=bpe_processor,
        reward=1.0,
        version=0,
        fetched_images=captured.images(capture),
    )
    assert res.row is not None, res.reason
    # Every call trained: a row per segment, in turn order.
    assert res.stats["prefix_breaks"] == 1 and res.stats["trained_turns"] == 4
    assert len(res.rows) == 2 and res.trained == {0, 1, 2, 3}
    for row, seg in zip(res.rows, segments, strict=True):
        assert row["input_ids"][0].tolist() == seg.ids


async def test_a_server_without_tokens_in_falls_back_to_text_and_counts_breaks(
    open_episode, gateway, vllm_bpe_server, tiny_vl_bpe_model_dir, bpe_processor
):
    """A vLLM without the tokens-in endpoint (here: a proxy that answers it 404 and passes chat
    completions to the real server): the episode goes on with text in, every call is counted,
    the row builder splits where the server's re-tokenised prompt broke the prefix, and the
    logprobs are still the model's."""
    app = FastAPI()

    @app.post("/inference/v1/generate")
    async def no_tokens_in():
        return Response(status_code=404)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.post(
                f"{vllm_bpe_server.base_url}/chat/completions", json=await request.json()
            )
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    with ThreadedServer(app, name="no-tokens-in") as proxy:
        episode, url, _ = open_episode(
            engine=FakeEngine(proxy.url.removeprefix("http://")),
            sampling=Sampling(temperature=1.0, max_new_tokens=12),
        )
        messages: list[dict] = [{"role": "system", "content": "You operate a phone."}]
        async with httpx.AsyncClient(timeout=120) as http:
            for n in range(3):
                messages.append(user(f"Step {n + 1}", data_url(png((80 * n, 40, 90)))))
                r = await http.post(f"{url}/chat/completions", json={"messages": messages})
                assert r.status_code == 200, r.text
                messages.append(r.json()["choices"][0]["message"])
    capture = gateway.close(episode)
    stats = capture.stats()
    assert (
        stats["gateway/text_in_calls"] == 3 and [t.backend for t in capture.turns] == ["text"] * 3
    )
    turns = captured.row_turns(capture, [])
    _, breaks = split_segments(turns)
    assert breaks == stats["gateway/not_extended"]
    res = convert_turns(
        turns,
        processor=bpe_processor,
        reward=1.0,
        version=0,
        fetched_images=captured.images(capture),
    )
    assert res.row is not None, res.reason
    assert res.stats["prefix_breaks"] == breaks and res.stats["trained_turns"] == 3
    gap = trained_gap(load_vl_model(tiny_vl_bpe_model_dir), res.row)  # every row of the episode
    assert gap.max().item() < 1e-3
