"""Re-asks against re-sends, over HTTP through the gateway to the model stand-in.

An agent asks the same request again when a reply did not parse (MAI-UI's does, up to 3 times):
each is a new call, sampled and captured. Only a re-send of an answer the client never got (the
official SDKs' automatic retry, ``x-stainless-retry-count`` > 0, or any identical request while
the generation is undelivered) is answered from what was already sampled.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai

from cua_rl.testing.model_standin import ModelStandIn
from tests.gateway.conftest import user

SCRIPT = ((40, 41), (42, 43), (44, 45))


async def _until(check, what: str, bound_s: float = 60.0) -> None:
    """Wait (bounded) for a state the gateway reaches by itself."""
    for _ in range(int(bound_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} within {bound_s} s")


async def test_the_same_request_asked_three_times_is_three_trained_calls(standin_episode):
    standin = ModelStandIn(script=SCRIPT)
    gw, episode, url, _ = standin_episode(standin)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    messages = [user("Tap the button")]
    answers = [
        await client.chat.completions.create(model="policy", messages=messages) for _ in range(3)
    ]
    await client.close()
    capture = gw.close(episode)
    assert standin.calls == 3
    assert [t.response_id for t in capture.turns] == [a.id for a in answers]
    assert [t.output_ids for t in capture.turns] == [list(s) for s in SCRIPT]
    assert [a.choices[0].message.content for a in answers] == [t.text for t in capture.turns]
    assert len({t.text for t in capture.turns}) == 3
    # Each re-ask sends the first call's exact prompt ids, not a re-rendering.
    assert capture.turns[1].prompt_ids == capture.turns[0].prompt_ids
    assert capture.turns[2].prompt_ids == capture.turns[0].prompt_ids
    stats = capture.stats()
    assert stats["gateway/reasks"] == 2 and stats["gateway/resends"] == 0
    assert stats["gateway/calls"] == 3


async def test_a_reask_later_in_the_episode_sends_the_sampled_ids_not_a_rerendering(
    standin_episode,
):
    # "t", "h", "e" sampled one by one: re-tokenising the text gives the single token "the".
    standin = ModelStandIn(script=((97, 85, 82), (40, 41), (42, 43)))
    gw, episode, url, _ = standin_episode(standin)
    messages = [user("Tap the button")]
    async with httpx.AsyncClient(timeout=60) as http:
        first = (await http.post(f"{url}/chat/completions", json={"messages": messages})).json()
        messages += [first["choices"][0]["message"], user("And now?")]
        for _ in range(2):
            r = await http.post(f"{url}/chat/completions", json={"messages": messages})
            assert r.status_code == 200
    capture = gw.close(episode)
    one, two, again = capture.turns
    assert first["choices"][0]["message"]["content"] == "the"
    assert two.prompt_ids[: len(one.prompt_ids) + 3] == one.prompt_ids + [97, 85, 82]
    assert again.prompt_ids == two.prompt_ids
    assert again.segment == two.segment + 1
    assert capture.stats()["gateway/reasks"] == 1


async def test_an_sdk_retry_across_a_held_answer_joins_the_one_generation(standin_episode):
    hold = threading.Event()
    standin = ModelStandIn(script=SCRIPT, hold=hold)
    gw, episode, url, _ = standin_episode(standin)
    session = gw._lookup(episode)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=1.0, max_retries=2)
    call = asyncio.ensure_future(
        client.chat.completions.create(model="policy", messages=[user("Tap the button")])
    )
    try:
        # The answer is held until the SDK's first attempt timed out and left.
        await _until(lambda: session.capture.disconnects >= 1, "the first attempt left")
        hold.set()
        answer = await call
    finally:
        hold.set()
        await client.close()
    capture = gw.close(episode)
    assert standin.calls == 1
    (turn,) = capture.turns
    assert answer.id == turn.response_id
    assert answer.choices[0].message.content == turn.text
    stats = capture.stats()
    # Every later attempt (the SDK's retries) joined the one generation.
    assert stats["gateway/resends"] == stats["gateway/disconnects"] >= 1
    assert stats["gateway/reasks"] == 0
    assert stats["gateway/discarded_generations"] == 0


async def test_a_retry_count_after_a_delivered_answer_gets_the_stored_answer(standin_episode):
    standin = ModelStandIn(script=SCRIPT)
    gw, episode, url, _ = standin_episode(standin)
    body = {"messages": [user("Tap the button")]}
    async with httpx.AsyncClient(timeout=60) as http:
        first = await http.post(f"{url}/chat/completions", json=body)
        again = await http.post(
            f"{url}/chat/completions", json=body, headers={"x-stainless-retry-count": "1"}
        )
        reask = await http.post(
            f"{url}/chat/completions", json=body, headers={"x-stainless-retry-count": "0"}
        )
    assert first.status_code == again.status_code == reask.status_code == 200
    assert again.json() == first.json()
    assert reask.json()["id"] != first.json()["id"]
    capture = gw.close(episode)
    assert standin.calls == 2
    assert [t.response_id for t in capture.turns] == [first.json()["id"], reask.json()["id"]]
    stats = capture.stats()
    assert stats["gateway/resends"] == 1 and stats["gateway/reasks"] == 1


async def _stream(http: httpx.AsyncClient, url: str, body: dict, retry: int) -> dict:
    headers = {"x-stainless-retry-count": str(retry)}
    async with http.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return json.loads(data[0])


async def test_streams_follow_the_same_rule(standin_episode):
    standin = ModelStandIn(script=SCRIPT)
    gw, episode, url, _ = standin_episode(standin)
    body = {"messages": [user("Tap the button")], "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        first = await _stream(http, url, body, 0)
        resent = await _stream(http, url, body, 1)
        reask = await _stream(http, url, body, 0)
    assert resent["id"] == first["id"] and reask["id"] != first["id"]
    capture = gw.close(episode)
    assert [t.response_id for t in capture.turns] == [first["id"], reask["id"]]
    assert standin.calls == 2


async def test_a_malformed_retry_count_is_refused(standin_episode):
    standin = ModelStandIn()
    gw, episode, url, _ = standin_episode(standin)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{url}/chat/completions",
            json={"messages": [user("x")]},
            headers={"x-stainless-retry-count": "soon"},
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert "x-stainless-retry-count" in r.json()["error"]["message"]
    assert standin.calls == 0
    gw.close(episode)
