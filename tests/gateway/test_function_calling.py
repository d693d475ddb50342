"""Function calling through the gateway, driven by the official Python ``openai`` SDK.

A GUI agent hands the model its functions, executes the ``tool_calls`` it gets and sends their
results back as ``tool`` messages. Tiny random models never write a ``<tool_call>`` by
themselves, so the episodes that need calls get them from a stand-in model server answering
fixed token sequences (the tokens a Qwen2.5-VL would sample); the history re-render, the capture
and the row are then the gateway's real work. Against real vLLM (slow), the agent brings tool
calls and tool results as earlier history, the reply is parsed from what the model sampled, and
the row must reproduce under a transformers forward.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from cua_rl.core.images import image_token_ids
from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.render import collapse_pads
from cua_rl.serving import ThreadedServer
from cua_rl.testing.cache import ensure_model
from cua_rl.testing.model_standin import ModelStandIn
from cua_rl.trajectory import captured
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, data_url, png, row_of, user

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "tap",
            "description": "Tap a point of the screen.",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "type_text",
            "description": "Type text into the focused field.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
    },
]
SYSTEM = {"role": "system", "content": "You operate a phone."}
TAP = '<tool_call>\n{"name": "tap", "arguments": {"x": 10, "y": 20}}\n</tool_call>'
TYPE = '<tool_call>\n{"name": "type_text", "arguments": {"text": "héllo"}}\n</tool_call>'


def shot(n: int) -> str:
    return data_url(png((50 * n, 90, 200 - 40 * n)))


@pytest.fixture(scope="module")
def qwen25_processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ensure_model("qwen2.5-vl"))


def sampled(processor, text: str) -> tuple[int, ...]:
    """The ids a model would sample to write ``text`` and end its turn."""
    tok = processor.tokenizer
    return (*tok.encode(text, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture
def standin_gateway(qwen25_processor):
    """standin_gateway(standin, **config) -> (gateway, episode id, base URL)."""
    started: list[tuple[Gateway, ThreadedServer]] = []

    def make(standin: ModelStandIn, **config):
        server = ThreadedServer(standin.app, name="model-standin").start()
        gw = Gateway(GatewayConfig(**config)).start()
        started.append((gw, server))
        spec = SessionSpec(
            FakeEngine(f"{server.host}:{server.port}"),
            Sampling(max_new_tokens=256),
            qwen25_processor,
            "policy",
            TrajectoryConfig(),
        )
        return gw, "ep", gw.open("ep", spec)

    yield make
    for gw, server in started:
        gw.stop()
        server.stop()


def execute(call) -> str:
    """The agent's side: run the function the model called."""
    args = json.loads(call.function.arguments)
    if call.function.name == "tap":
        return f"tapped at {args['x']},{args['y']}"
    return f"typed {args['text']}"


async def run_agent(
    url: str, first: str, turns: int, screenshots: bool = True, **create
) -> tuple[list, list[dict]]:
    """An SDK agent: each reply appended as returned, its calls executed, results as ``tool``
    messages, then the next screen (with a screenshot unless ``screenshots`` is false: the
    stand-in does not expand image pads as vLLM does, so its rows hold none). Returns the
    replies and the final history."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    messages: list[dict] = [SYSTEM, user(first, shot(1) if screenshots else None)]
    replies = []
    for n in range(turns):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, **create
        )
        replies.append(r)
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": execute(call)})
        if n + 1 < turns:
            screen = shot(n + 2) if screenshots else None
            messages.append(user(f"Screen after step {n + 1}", screen))
    await client.close()
    return replies, messages


async def test_an_sdk_agent_executes_tool_calls_over_several_turns_in_one_exact_row(
    standin_gateway, qwen25_processor
):
    script = (
        sampled(qwen25_processor, "I will tap the field.\n" + TAP),
        sampled(qwen25_processor, TYPE),
        sampled(qwen25_processor, "Done."),
    )
    standin = ModelStandIn(script=script)
    gw, episode, url = standin_gateway(standin)
    replies, messages = await run_agent(url, "Fill in the form", 3, screenshots=False)

    one, two, three = (r.choices[0] for r in replies)
    assert one.finish_reason == two.finish_reason == "tool_calls"
    assert one.message.content == "I will tap the field.\n" and two.message.content is None
    assert [
        (c.type, c.function.name, json.loads(c.function.arguments))
        for c in one.message.tool_calls + two.message.tool_calls
    ] == [
        ("function", "tap", {"x": 10, "y": 20}),
        ("function", "type_text", {"text": "héllo"}),
    ]
    assert len({c.id for c in one.message.tool_calls + two.message.tool_calls}) == 2
    assert three.finish_reason == "stop" and three.message.content == "Done."
    assert three.message.tool_calls is None

    # The last prompt reads as the template writes the history with each reply as sampled
    # (the stored ids; re-tokenising the whole would merge them otherwise, so compare text).
    tok = qwen25_processor.tokenizer
    replies_text = iter(tok.decode(s, skip_special_tokens=True) for s in script)
    as_sampled = [
        {"role": "assistant", "content": next(replies_text)} if m["role"] == "assistant" else m
        for m in messages[:-1]
    ]
    got = tok.decode(standin.last["token_ids"], skip_special_tokens=False)
    assert got == _render(qwen25_processor, as_sampled)
    # The template's own rendering of the calls as the agent sent them back differs from the
    # sampled text by one newline (content keeps the "\n" before <tool_call>, vLLM's rule, and
    # the template writes one more): the reason the sampled ids are kept, not re-rendered.
    agent_view = _render(qwen25_processor, messages[:-1])
    assert agent_view != got
    assert agent_view.replace("field.\n\n<tool_call>", "field.\n<tool_call>") == got

    capture = gw.close(episode)
    assert [t.segment for t in capture.turns] == [1, 1, 1]
    assert all(t.extended for t in capture.turns)
    assert [list(t.output_ids) for t in capture.turns] == [list(s) for s in script]
    notes = [captured.call_notes(t) for t in capture.turns]
    assert notes[0]["tools_schema"] == TOOLS and "tools_schema" not in notes[1]
    assert [n.get("tool_calls") for n in notes] == [["tap"], ["type_text"], None]
    row_of(capture, qwen25_processor, 3)


def _render(processor, messages: list[dict]) -> str:
    return processor.apply_chat_template(
        [_template_message(m) for m in messages],
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )


def _template_message(message: dict) -> dict:
    """A message as a template reads it: images as placeholders, call arguments as objects."""
    out = dict(message)
    if isinstance(out.get("content"), list):
        out["content"] = [
            {"type": "image"} if p["type"] == "image_url" else p for p in out["content"]
        ]
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in out["tool_calls"]
        ]
    return out


async def test_a_call_written_unlike_the_template_keeps_its_sampled_ids(
    standin_gateway, qwen25_processor
):
    # Compact JSON: the template would write the call back with spaces, the model did not.
    compact = '<tool_call>{"name":"tap","arguments":{"x":10,"y":20}}</tool_call>'
    script = (sampled(qwen25_processor, compact), sampled(qwen25_processor, "ok"))
    standin = ModelStandIn(script=script)
    gw, episode, url = standin_gateway(standin)
    replies, _ = await run_agent(url, "Tap", 2)
    assert replies[0].choices[0].message.tool_calls[0].function.arguments == '{"x": 10, "y": 20}'
    capture = gw.close(episode)
    first, second = capture.turns
    assert second.segment == 1 and second.extended
    stored = [*first.prompt_ids, *first.output_ids]
    pad, _ = image_token_ids(qwen25_processor)
    assert standin.last["token_ids"][: len(collapse_pads(stored, pad))] == collapse_pads(
        stored, pad
    )


async def test_tool_choice_none_answers_text_and_forcing_a_call_is_refused(
    standin_gateway, qwen25_processor
):
    standin = ModelStandIn(script=(sampled(qwen25_processor, TAP),))
    gw, episode, url = standin_gateway(standin)
    body = {"messages": [user("x")], "tools": TOOLS}
    async with httpx.AsyncClient(timeout=60) as http:
        post = lambda **extra: http.post(f"{url}/chat/completions", json={**body, **extra})  # noqa: E731
        none = await post(tool_choice="none")
        required = await post(tool_choice="required")
        named = await post(tool_choice={"type": "function", "function": {"name": "tap"}})
    choice = none.json()["choices"][0]
    assert choice["message"]["content"] == TAP and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    for r in (required, named):
        assert r.status_code == 400
        error = r.json()["error"]
        assert (
            error["code"] == "tool_choice_unsupported"
            and "constrained decoding" in error["message"]
        )
    assert standin.calls == 1
    gw.close(episode)


async def test_a_streamed_answer_carries_its_tool_calls(standin_gateway, qwen25_processor):
    standin = ModelStandIn(script=(sampled(qwen25_processor, "Tap.\n" + TAP),))
    gw, episode, url = standin_gateway(standin)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    stream = await client.chat.completions.create(
        model="policy", messages=[user("x")], tools=TOOLS, stream=True
    )
    deltas, finish = [], None
    async for chunk in stream:
        deltas.append(chunk.choices[0].delta)
        finish = chunk.choices[0].finish_reason or finish
    await client.close()
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "tap", {"x": 10, "y": 20})
    ]
    assert "".join(d.content or "" for d in deltas) == "Tap.\n" and finish == "tool_calls"
    gw.close(episode)


async def test_a_stop_string_cuts_the_reply_and_the_row_keeps_what_the_agent_got(
    standin_gateway, qwen25_processor
):
    standin = ModelStandIn(script=(sampled(qwen25_processor, "tap the OK button\nObservation: x"),))
    gw, episode, url = standin_gateway(standin)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{url}/chat/completions",
            json={"messages": [user("x")], "stop": ["\nObservation:"], "logprobs": True},
        )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "tap the OK button"
    assert standin.last["sampling_params"]["stop"] == ["\nObservation:"]
    (turn,) = gw.close(episode).turns
    tok = qwen25_processor.tokenizer
    assert tok.decode(turn.output_ids) == "tap the OK button"
    assert len(choice["logprobs"]["content"]) == len(turn.output_ids) == len(turn.logprobs)
    assert "stop" not in turn.overridden


@pytest.fixture(scope="module")
def qwen25_vllm():
    from cua_rl.testing.vllm_server import VLLMServer

    with VLLMServer(ensure_model("qwen2.5-vl"), model="tiny-qwen2.5-vl") as server:
        yield server


@pytest.fixture
def vllm_episode(qwen25_vllm, qwen25_processor):
    """vllm_episode(sampling) -> (gateway, episode id, base URL) on the real vLLM server."""
    gw = Gateway(GatewayConfig()).start()
    opened = []

    def make(sampling: Sampling, gateway: Gateway | None = None):
        episode = f"ep-{len(opened)}"
        spec = SessionSpec(
            FakeEngine(f"{qwen25_vllm.host}:{qwen25_vllm.port}"),
            sampling,
            qwen25_processor,
            qwen25_vllm.model,
            TrajectoryConfig(),
        )
        opened.append(episode)
        return (gateway or gw), episode, (gateway or gw).open(episode, spec)

    yield make
    gw.stop()


def _history() -> list[dict]:
    """A GUI agent's conversation that already holds a call and its result."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "tap", "arguments": '{"x": 10, "y": 20}'},
    }
    return [
        SYSTEM,
        user("Open the settings", shot(1)),
        {"role": "assistant", "content": "Tapping settings.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "tapped at 10,20"},
        user("Screen after the tap", shot(2)),
    ]


@pytest.mark.slow
async def test_real_vllm_tool_history_renders_as_the_template_and_the_row_reproduces(
    vllm_episode, qwen25_processor
):
    from cua_rl.testing.forward import load_vl_model, trained_gap

    gw, episode, url = vllm_episode(Sampling(temperature=1.0, max_new_tokens=24))
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    messages = _history()
    replies = []
    for n in range(3):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True, top_logprobs=3
        )
        replies.append(r)
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": execute(call)})
        messages.append(user(f"Screen {n + 3}", shot(n + 3)))
    await client.close()
    capture = gw.close(episode)

    # The first prompt is the template's rendering of the agent's history, tool call and tool
    # result included (one pad per image as sent; the server expanded them).
    tok = qwen25_processor.tokenizer
    pad, _ = image_token_ids(qwen25_processor)
    first = tok.decode(collapse_pads(capture.turns[0].prompt_ids, pad), skip_special_tokens=False)
    assert first == _render(qwen25_processor, _history())
    # The reply was parsed from what the model sampled, as vLLM's Hermes parser would.
    from cua_rl.gateway.tools import parse_hermes

    for r, turn in zip(replies, capture.turns, strict=True):
        parsed = parse_hermes(turn.text)
        assert r.choices[0].message.content == parsed.content
        assert len(r.choices[0].message.tool_calls or []) == len(parsed.calls)
        _check_top_logprobs(r.choices[0].logprobs.content, turn)
    assert {t.segment for t in capture.turns} == {1} and all(t.extended for t in capture.turns)

    row = row_of(capture, qwen25_processor, 3)
    gap = trained_gap(load_vl_model(ensure_model("qwen2.5-vl")), row).max().item()
    print(f"forward max |dlogprob| {gap:.2e}")
    assert gap < 1e-3


def _check_top_logprobs(entries, turn) -> None:
    """Top candidates: 3 per token, by logprob, the sampled one's logprob where it is among
    them; the sampled token's own logprob is the one trained on."""
    assert [e.logprob for e in entries] == pytest.approx(turn.logprobs)
    assert len(entries) == len(turn.output_ids)
    for e in entries:
        tops = e.top_logprobs
        assert len(tops) == 3
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].logprob >= e.logprob - 1e-6
        same = [t for t in tops if t.bytes == e.bytes]
        if same:
            assert same[0].logprob == pytest.approx(e.logprob, abs=1e-6)


@pytest.mark.slow
async def test_real_vllm_honours_stop_and_the_row_keeps_what_the_agent_got(vllm_episode):
    greedy = Sampling(greedy=True, max_new_tokens=24)
    body = {"messages": [user("Say something", shot(1))]}
    async with httpx.AsyncClient(timeout=300) as http:
        _, _, url = vllm_episode(greedy)
        free = (await http.post(f"{url}/chat/completions", json=body)).json()
        text = free["choices"][0]["message"]["content"]
        assert len(text) > 8, text
        stop = text[4:7]
        gw, episode, url = vllm_episode(greedy)
        cut = await http.post(f"{url}/chat/completions", json={**body, "stop": stop})
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    content = choice["message"]["content"]
    assert text.startswith(content) and stop not in content
    assert len(content) <= text.index(stop)
    (turn,) = gw.close(episode).turns
    assert turn.text == content


@pytest.mark.slow
async def test_text_in_sends_the_tools_for_the_server_to_render(vllm_episode, qwen25_processor):
    text_gw = Gateway(GatewayConfig(backend="text")).start()
    try:
        gw, episode, url = vllm_episode(Sampling(max_new_tokens=8), text_gw)
        async with httpx.AsyncClient(timeout=300) as http:
            r = await http.post(
                f"{url}/chat/completions", json={"messages": _history(), "tools": TOOLS}
            )
        assert r.status_code == 200, r.text
        (turn,) = gw.close(episode).turns
    finally:
        text_gw.stop()
    assert turn.backend == "text"
    tok = qwen25_processor.tokenizer
    pad, _ = image_token_ids(qwen25_processor)
    prompt = tok.decode(collapse_pads(turn.prompt_ids, pad), skip_special_tokens=False)
    assert prompt == _render(qwen25_processor, _history())
