"""The local agent end to end with a real vLLM CPU server (tiny random Qwen2-VL, byte tokenizer).

Every test drives runs through ``cua_rl.agent.service_driver`` against the real agent and gym; faults are
injected only into the driver's transport. Decoding is constrained to the action language so the
random model acts validly; ``finished`` is left out where a run must last a set number of steps.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from cua_rl.agent.service_driver import DriverConfig, RunDriver, drive_run
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from tests.agent.conftest import FaultyTransport

pytestmark = pytest.mark.slow

NO_FINISH = ["tap", "swipe", "type", "key", "back", "home", "wait"]


def _model_options(**extra) -> dict:
    return {"constrain": "regex", "actions": NO_FINISH, **extra}


def _model_outputs(events):
    return [e["modelOutput"] for e in events if e["type"] == "model_output"]


def _requests(events):
    return [e["modelSpecificInput"] for e in events if e["type"] == "model_call"]


async def test_six_step_run_carries_token_ids_and_logprobs_every_step(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=6,
        model_options=_model_options(),
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=300))
    s = result.summary
    assert (s.status, s.reason, s.steps, s.errors) == ("completed", "max_steps", 6, [])

    per_step = ["step_start", "model_call", "model_output", "action_executed", "step_end"]
    assert [e["type"] for e in result.events] == per_step * 6 + ["run_end"]
    assert [e["step"] for e in result.events[:-1]] == [n for n in range(1, 7) for _ in per_step]
    stamps = [e["ts"] for e in result.events]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)

    outputs = _model_outputs(result.events)
    assert len(outputs) == 6
    for out in outputs:
        choice = out["choices"][0]
        assert out["prompt_token_ids"] and all(isinstance(t, int) for t in out["prompt_token_ids"])
        assert choice["token_ids"], out
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"])
        assert all(isinstance(c["logprob"], float) and c["logprob"] <= 0.0 for c in content)

    requests = _requests(result.events)
    for n, req in enumerate(requests):
        assert req["logprobs"] is True and req["return_token_ids"] is True
        assert req["model"] == vllm_server.model and "structured_outputs" in req
        images = [
            p["image_url"]["url"]
            for m in req["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image_url"
        ]
        assert len(images) == n + 1 and all(u.startswith("data:image/png;base64,") for u in images)
    # Append-only history: each request extends the previous one by the model's verbatim
    # answer and one new screenshot message.
    for prev, nxt, out in zip(requests, requests[1:], outputs, strict=False):
        text = out["choices"][0]["message"]["content"]
        assert nxt["messages"][: len(prev["messages"])] == prev["messages"]
        assert nxt["messages"][len(prev["messages"])] == {"role": "assistant", "content": text}
        assert len(nxt["messages"]) == len(prev["messages"]) + 2
    # Constrained turns end on <|im_end|>, so each prompt starts with the previous prompt + output.
    for prev, nxt in zip(outputs, outputs[1:], strict=False):
        head = prev["prompt_token_ids"] + prev["choices"][0]["token_ids"]
        assert nxt["prompt_token_ids"][: len(head)] == head

    actions = [e["action"] for e in result.events if e["type"] == "action_executed"]
    assert all(a["name"] in NO_FINISH for a in actions), actions
    texts = [o["choices"][0]["message"]["content"] for o in outputs]
    assert [a["rawFeedback"] for a in actions] == texts  # each output was exactly one call

    async with MiniAgentClient(agent.url) as client, httpx.AsyncClient() as http:
        steps = await client.get_steps(s.run_id)
        assert [st["index"] for st in steps] == list(range(6))
        first = steps[0]["messages"]
        assert first[0]["role"] == "system" and first[2]["callId"] == "__step_message_image__"
        shots = [st["actions"][0]["obs"]["screenshots"][0] for st in steps]
        for before, after in zip(shots, shots[1:], strict=False):
            assert before["screenshot_after"] == after["screenshot_before"]
        png = await http.get(shots[0]["screenshot_before"])
        assert png.status_code == 200 and png.content[:4] == b"\x89PNG"
        tokens = (await client.get_tokens(s.run_id))["steps"]
        assert [t["token_ids"] for t in tokens] == [o["choices"][0]["token_ids"] for o in outputs]
    # Every action was executed by the gym (its answer names the screen) and every step's
    # screenshot was captured on this run's execution.
    assert all("screen" in a["rawResult"] for a in actions), actions
    assert len(gym.gym.get(ex).screenshots) == 6


async def test_top_logprobs_and_gym_image_urls(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=2,
        model_options=_model_options(topLogprobs=3, imageMode="url"),
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=120))
    assert result.summary.reason == "max_steps", result.summary
    req = _requests(result.events)[-1]
    assert req["top_logprobs"] == 3
    urls = [
        p["image_url"]["url"]
        for m in req["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    ]
    assert len(urls) == 2 and all(u.startswith(f"{gym.base_url}/executions/{ex}/") for u in urls)
    for out in _model_outputs(result.events):
        assert all(len(c["top_logprobs"]) == 3 for c in out["choices"][0]["logprobs"]["content"])


async def test_unconstrained_garbage_is_reported_as_invalid_and_the_run_goes_on(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=2,
        model_options={"logprobs": False},
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=120))
    assert (result.summary.status, result.summary.reason) == ("completed", "max_steps")
    actions = [e["action"] for e in result.events if e["type"] == "action_executed"]
    assert [a["name"] for a in actions] == ["invalid", "invalid"]
    assert all(a["rawResult"]["ok"] is False for a in actions)
    assert all("parse_error" in a["rawResult"]["error"] for a in actions)
    assert all("screen" not in a["rawResult"] for a in actions)  # nothing was executed
    req = _requests(result.events)[0]
    assert "logprobs" not in req and "return_token_ids" not in req


async def test_eight_parallel_runs_do_not_interfere(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    from cua_rl.sim.phone_tasks import TASKS

    task_ids = [t.task_id for t in TASKS][:8]
    assert len(task_ids) == 8
    executions = [await new_execution(t) for t in task_ids]
    max_steps = [3, 4, 5, 3, 4, 5, 3, 4]
    specs = [
        vllm_spec_for(
            ex,
            task=f"task number {i}",
            max_steps=n,
            model_options=_model_options(imageMode="url"),
        )
        for i, (ex, n) in enumerate(zip(executions, max_steps, strict=True))
    ]
    cfg = DriverConfig(deadline_s=400, poll_initial_s=0.1, poll_max_s=0.5)
    async with MiniAgentClient(agent.url) as client:
        results = await asyncio.gather(*(RunDriver(client, cfg).run(sp) for sp in specs))
    assert len({r.summary.run_id for r in results}) == 8
    for i, (res, ex, n) in enumerate(zip(results, executions, max_steps, strict=True)):
        s = res.summary
        assert (s.status, s.reason, s.steps) == ("completed", "max_steps", n), s
        reqs = _requests(res.events)
        assert len(reqs) == n
        assert reqs[-1]["messages"][1]["content"] == f"Task: task number {i}"
        urls = [
            p["image_url"]["url"]
            for m in reqs[-1]["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image_url"
        ]
        assert len(urls) == n and all(f"/executions/{ex}/" in u for u in urls)
        executed = [e["action"] for e in res.events if e["type"] == "action_executed"]
        assert len(executed) == n and all("screen" in a["rawResult"] for a in executed)
        assert len(gym.gym.get(ex).screenshots) == n


async def test_driver_survives_an_agent_that_drops_connections(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()

    # Every third request: a poll is two GETs (status, events), so the drops fall on both kinds
    # and, as the poll count grows, on the final fetch too.
    def drop_every_third_get(request: httpx.Request, n: int):
        if request.method == "GET" and n % 3 == 0:
            return httpx.RemoteProtocolError("peer closed connection", request=request)
        return None

    transport = FaultyTransport(drop_every_third_get)
    spec = vllm_spec_for(
        ex,
        max_steps=5,
        model_options=_model_options(),
    )
    cfg = DriverConfig(deadline_s=300, poll_initial_s=0.05, poll_max_s=0.3)
    async with httpx.AsyncClient(transport=transport) as http:
        result = await drive_run(agent.url, spec, config=cfg, client=http)
    s = result.summary
    assert (s.status, s.reason, s.steps) == ("completed", "max_steps", 5)
    assert s.transient_errors == transport.injected >= 2
    dropped = {p for p in transport.dropped_paths}
    assert dropped == {f"/runs/{s.run_id}", f"/runs/{s.run_id}/events"}, dropped
    async with MiniAgentClient(agent.url) as client:
        assert result.events == await client.get_events(s.run_id)  # nothing lost, no duplicates


async def test_run_that_never_ends_stops_at_the_client_deadline(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=100_000,
        model_options=_model_options(),
    )
    t0 = time.monotonic()
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=3, poll_max_s=0.5))
    elapsed = time.monotonic() - t0
    s = result.summary
    assert s.reason == "deadline" and s.status == "running"
    # The run never ends by itself: returning at all is the deadline at work. The bound only
    # rules out waiting for more polls; its slack is a busy machine's, not a measurement.
    assert elapsed < 3 + 2.5 + 20  # deadline plus the bounded last fetch
    assert result.events and result.events[0]["type"] == "step_start"
    # No cancel endpoint: terminating the gym execution is what stops the run.
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{gym.base_url}/executions/{ex}/terminate")
        assert resp.status_code == 200
    async with MiniAgentClient(agent.url) as client:
        for _ in range(600):  # a bound for a hung agent, not a speed assumption
            run = await client.get_run(s.run_id)
            if run["status"] != "running":
                break
            await asyncio.sleep(0.1)
        assert (run["status"], run["reason"]) == ("failed", "env_error")
        events = await client.get_events(s.run_id)
    assert events[-1]["type"] == "run_end" and events[-1]["reason"] == "env_error"


async def test_max_run_time_ends_the_run_agent_side(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=100_000,
        max_run_time_s=2,
        model_options=_model_options(),
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=60))
    s = result.summary
    assert (s.status, s.reason) == ("failed", "timeout")
    assert result.events[-1] == {**result.events[-1], "type": "run_end", "ok": False}
    assert any("maxRunTimeSec" in m for m in s.errors)


async def test_finished_ends_the_run_with_the_answer(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=5,
        model_options={"constrain": "regex", "actions": ["finished"]},
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=120))
    s = result.summary
    assert (s.status, s.reason, s.steps) == ("completed", "finished", 1)
    assert result.events[-1]["type"] == "run_end" and result.events[-1]["ok"] is True
    text = _model_outputs(result.events)[0]["choices"][0]["message"]["content"]
    literal = re.fullmatch(r'finished\("([a-z ]*)"\)', text)
    assert literal, text
    assert s.answer == literal.group(1)
    # Nothing was executed on the gym for `finished`, and its event args carry the answer.
    action = next(e["action"] for e in result.events if e["type"] == "action_executed")
    assert action == {**action, "name": "finished", "args": {"content": literal.group(1)}}


async def test_ascii_constraint_keeps_tokens_printable_and_the_prefix_property(
    agent, gym, vllm_server, new_execution, vllm_spec_for
):
    ex = await new_execution()
    spec = vllm_spec_for(
        ex,
        max_steps=4,
        model_options={"constrain": "ascii", "maxTokens": 16},
    )
    result = await drive_run(agent.url, spec, config=DriverConfig(deadline_s=120))
    assert (result.summary.status, result.summary.reason) == ("completed", "max_steps")
    requests, outputs = _requests(result.events), _model_outputs(result.events)
    allowed = set(requests[0]["allowed_token_ids"])
    async with httpx.AsyncClient() as http:
        root = vllm_server.base_url[: -len("/v1")]
        resp = await http.post(
            f"{root}/detokenize", json={"model": vllm_server.model, "tokens": sorted(allowed)}
        )
    text = resp.json()["prompt"]
    # Printable ASCII plus <|im_end|>, nothing else.
    assert set(text.replace("<|im_end|>", "")) <= {chr(c) for c in range(32, 127)}
    assert "<|im_end|>" in text and len(allowed) <= 96
    for out in outputs:
        assert set(out["choices"][0]["token_ids"]) <= allowed
    for prev, nxt in zip(outputs, outputs[1:], strict=False):
        head = prev["prompt_token_ids"] + prev["choices"][0]["token_ids"]
        assert nxt["prompt_token_ids"][: len(head)] == head
    # Whatever the random model wrote, every step was reported (valid or `invalid`).
    actions = [e["action"] for e in result.events if e["type"] == "action_executed"]
    assert len(actions) == 4
