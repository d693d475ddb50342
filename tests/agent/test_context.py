"""Context policies (cua_rl/agent/context.py): the messages each policy builds for a 6-step
episode, checked against hand-written expected messages, the device-dependent prompts, and the
local agent over HTTP with the mai-ui policy (a scripted model server, the real sim gym)."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI, Request

from cua_rl.agent.context import (
    ContextPolicy,
    Screen,
    StepRecord,
    build_messages,
    count_images,
)
from cua_rl.agent.flavours import get_flavour
from cua_rl.serving import ThreadedServer
from tests.agent.test_flavours import _events

W, H = 360, 640
MAI = get_flavour("mai-ui")
SIM = get_flavour("sim")
QWEN = get_flavour("qwen3-vl")

# Replies as a model might sample them: spaced JSON, float points, thoughts with padding. The
# history must hold the canonical form (right column), never these.
MAI_REPLIES = [
    '<thinking>\n open Settings \n</thinking>\n<tool_call>\n{"name": "mobile_use", '
    '"arguments": {"action": "click", "coordinate": [60.4, 106.6]}}\n</tool_call>',
    'scroll first<tool_call>{"name": "mobile_use", "arguments": {"action": "swipe", '
    '"direction": "up"}}</tool_call>',
    '<thinking>type</thinking><tool_call>\n{"name":"mobile_use","arguments":{"action":"type",'
    '"text":"hi"}}\n</tool_call> trailing words',
    '<thinking>\nback\n</thinking>\n<tool_call>\n{"name": "mobile_use", "arguments": '
    '{"action": "system_button", "button": "back"}}\n</tool_call>',
    '<tool_call>\n{"name": "mobile_use", "arguments": {"action": "wait"}}\n</tool_call>',
]
MAI_CANONICAL = [
    '<thinking>\nopen Settings\n</thinking>\n<tool_call>\n{"name":"mobile_use","arguments":'
    '{"action":"click","coordinate":[60,107]}}\n</tool_call>',
    '<thinking>\nscroll first\n</thinking>\n<tool_call>\n{"name":"mobile_use","arguments":'
    '{"action":"swipe","direction":"up"}}\n</tool_call>',
    '<thinking>\ntype\n</thinking>\n<tool_call>\n{"name":"mobile_use","arguments":'
    '{"action":"type","text":"hi"}}\n</tool_call>',
    '<thinking>\nback\n</thinking>\n<tool_call>\n{"name":"mobile_use","arguments":'
    '{"action":"system_button","button":"back"}}\n</tool_call>',
    '<thinking>\n\n</thinking>\n<tool_call>\n{"name":"mobile_use","arguments":'
    '{"action":"wait"}}\n</tool_call>',
]


def _screen(n: int) -> Screen:
    return Screen(n, f"data:image/png;base64,S{n}", W, H)


def _shot(n: int, note: str = "") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": f"Step {n}. Screen 360x640.{note}"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,S{n}"}},
        ],
    }


def _asst(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _history(flavour, replies, lenient=False) -> list[StepRecord]:
    out = []
    for i, reply in enumerate(replies, 1):
        try:
            action = flavour.read_reply(reply, W, H, lenient=lenient)
        except ValueError:
            action = None
        out.append(StepRecord(_screen(i), reply, action))
    return out


def _head(flavour, device="mobile") -> list[dict]:
    return [
        {"role": "system", "content": flavour.prompt(None, device)},
        {"role": "user", "content": "Task: Turn Wi-Fi on."},
    ]


def _requests(flavour, policy, replies, **kw) -> list[list[dict]]:
    history = _history(flavour, replies, lenient=kw.pop("lenient", False))
    return [
        build_messages("Turn Wi-Fi on.", history[: step - 1], _screen(step), flavour, policy, **kw)
        for step in range(1, 7)
    ]


def test_full_keeps_every_screenshot_and_the_sampled_text():
    requests = _requests(MAI, ContextPolicy("full"), MAI_REPLIES)
    assert [count_images(r) for r in requests] == [1, 2, 3, 4, 5, 6]
    expected = _head(MAI)
    for n, reply in enumerate(MAI_REPLIES, 1):
        expected += [_shot(n), _asst(reply)]
    assert requests[5] == [*expected, _shot(6)]
    # Append-only: each request starts with the previous one plus its reply.
    for k in range(5):
        assert requests[k + 1][: len(requests[k]) + 1] == [*requests[k], _asst(MAI_REPLIES[k])]


def test_mai_ui_rebuilds_with_canonical_history_and_a_window_of_three():
    requests = _requests(MAI, ContextPolicy("mai-ui", 3), MAI_REPLIES)
    assert [count_images(r) for r in requests] == [1, 2, 3, 3, 3, 3]
    c = [_asst(t) for t in MAI_CANONICAL]
    assert requests[0] == [*_head(MAI), _shot(1)]
    assert requests[1] == [*_head(MAI), _shot(1), c[0], _shot(2)]
    assert requests[2] == [*_head(MAI), _shot(1), c[0], _shot(2), c[1], _shot(3)]
    assert requests[3] == [*_head(MAI), c[0], _shot(2), c[1], _shot(3), c[2], _shot(4)]
    assert requests[5] == [*_head(MAI), c[0], c[1], c[2], _shot(4), c[3], _shot(5), c[4], _shot(6)]


def test_mai_ui_leaves_unparsed_steps_out():
    replies = [MAI_REPLIES[0], "no call at all", MAI_REPLIES[2], MAI_REPLIES[3], "<tool_call>{"]
    requests = _requests(MAI, ContextPolicy("mai-ui", 3), replies)
    c = [_asst(t) for t in MAI_CANONICAL]
    # Steps 2 and 5 did not parse: the window is over the kept steps 1, 3, 4.
    assert requests[5] == [*_head(MAI), c[0], _shot(3), c[2], _shot(4), c[3], _shot(6)]
    assert [count_images(r) for r in requests] == [1, 2, 2, 3, 3, 3]


def test_history_n_sets_the_window():
    requests = _requests(MAI, ContextPolicy("mai-ui", 1), MAI_REPLIES)
    assert [count_images(r) for r in requests] == [1] * 6
    c = [_asst(t) for t in MAI_CANONICAL]
    assert requests[2] == [*_head(MAI), c[0], c[1], _shot(3)]


def test_current_sends_one_screenshot_and_a_list_of_earlier_actions():
    requests = _requests(MAI, ContextPolicy("current"), MAI_REPLIES)
    assert [count_images(r) for r in requests] == [1] * 6
    assert requests[0] == [*_head(MAI), _shot(1)]
    note = (
        "\nPrevious actions:\n"
        '1. {"name":"mobile_use","arguments":{"action":"click","coordinate":[60,107]}}\n'
        '2. {"name":"mobile_use","arguments":{"action":"swipe","direction":"up"}}'
    )
    assert requests[2] == [*_head(MAI), _shot(3, note)]


def test_sim_flavour_renders_the_action_language():
    # Lenient reading: 'e' (101, cell 2) taps (300, 106); 'A' (65, cell 2) too; a valid call
    # keeps its own point; "   " stays unparsed and is left out.
    replies = ["enable", "tap( 10 ,20 )junk", "   ", 'type( "a b" )', "back()"]
    requests = _requests(SIM, ContextPolicy("mai-ui"), replies, lenient=True)
    assert requests[5][2:] == [
        _asst("tap(300, 106)"),
        _asst("tap(10, 20)"),
        _shot(4),
        _asst('type("a b")'),
        _shot(5),
        _asst("back()"),
        _shot(6),
    ]
    current = _requests(SIM, ContextPolicy("current"), replies, lenient=True)
    note = '\nPrevious actions:\n1. tap(300, 106)\n2. tap(10, 20)\n3. type("a b")\n4. back()'
    assert current[5] == [*_head(SIM), _shot(6, note)]


def test_qwen3_vl_renders_its_call_and_clicks_with_the_device_function():
    replies = [
        'I tap.\n<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", '
        '"coordinate": [10, 20.2]}}\n</tool_call>',
        "zz",  # lenient: 'z' is cell 5, (300, 320) -> [833, 500] on the grid
    ]
    requests = _requests(QWEN, ContextPolicy("mai-ui"), replies, lenient=True, device="pc")
    assert requests[2][2:] == [
        _shot(1),
        _asst(
            'I tap.\n<tool_call>\n{"name":"computer_use","arguments":{"action":"left_click",'
            '"coordinate":[10,20]}}\n</tool_call>'
        ),
        _shot(2),
        _asst(
            '<tool_call>\n{"name":"computer_use","arguments":{"action":"left_click",'
            '"coordinate":[833,500]}}\n</tool_call>'
        ),
        _shot(3),
    ]
    mobile = _requests(QWEN, ContextPolicy("current"), replies, lenient=True)
    assert mobile[2][2]["content"][0]["text"].endswith(
        '2. {"name":"mobile_use","arguments":{"action":"click","coordinate":[833,500]}}'
    )


def test_prompts_follow_the_device():
    assert "phone" in MAI.prompt(None, "mobile")
    pc = MAI.prompt(None, "pc")
    assert "phone" not in pc and "web page" in pc and '"name": "mobile_use"' in pc
    tools = QWEN.prompt(None, "pc").split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    declared = json.loads(tools)
    assert declared["function"]["name"] == "computer_use"
    assert "phone" not in json.dumps(declared)
    assert "left_click" in declared["function"]["parameters"]["properties"]["action"]["enum"]
    assert SIM.prompt(None, "pc").startswith("You operate a web page on a screen.")
    assert SIM.prompt(None, "mobile").startswith("You operate a phone.")


def test_bad_policies_say_what_to_fix():
    with pytest.raises(ValueError, match="context must be one of full, mai-ui, current"):
        ContextPolicy("window")
    with pytest.raises(ValueError, match="historyN must be an integer >= 1"):
        ContextPolicy("mai-ui", 0)
    assert ContextPolicy("mai-ui").max_asks == 3 and ContextPolicy("full").max_asks == 1


# ---- the local agent over HTTP: the mai-ui policy re-asks byte-identical requests ------------


def _scripted_model(replies: list[str]) -> FastAPI:
    """An OpenAI-compatible stand-in that answers ``replies`` in order and keeps each raw body."""
    app = FastAPI()
    app.state.bodies = []

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        app.state.bodies.append(await request.body())
        text = replies[len(app.state.bodies) - 1]
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    return app


def _call(action: str, **args) -> str:
    call = {"name": "mobile_use", "arguments": {"action": action, **args}}
    return f"<thinking>\nGo.\n</thinking>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _canonical(action: str, **args) -> str:
    call = {"name": "mobile_use", "arguments": {"action": action, **args}}
    body = json.dumps(call, separators=(",", ":"))
    return f"<thinking>\nGo.\n</thinking>\n<tool_call>\n{body}\n</tool_call>"


async def test_mai_ui_context_reasks_identically_and_keeps_three_screenshots(
    agent, gym, new_execution, spec_for
):
    replies = [
        _call("click", coordinate=[166, 166]),  # step 1: the Settings icon
        "I am not sure.",  # step 2: no call -> asked again
        _call("click", coordinate=[833, 166]),  # step 2: the Wi-Fi switch
        "x",  # step 3: three replies without a call: invalid, left out of the history
        "y",
        "z",
        _call("click", coordinate=[500, 500]),  # step 4: nothing there
        _call("answer", text="done"),  # step 5
    ]
    app = _scripted_model(replies)
    with ThreadedServer(app) as model:
        ex = await new_execution("sim-001-wifi-on")
        body = spec_for(
            ex,
            model_base_url=f"{model.url}/v1",
            max_steps=6,
            model_options={
                "flavour": "mai-ui",
                "context": "mai-ui",
                "logprobs": False,
                "imageMode": "url",
            },
        ).body()
        events = await _events(agent.url, body)
    raw = app.state.bodies
    assert len(raw) == 8
    # Re-asks send the same bytes.
    assert raw[1] == raw[2]
    assert raw[3] == raw[4] == raw[5]
    requests = [json.loads(b)["messages"] for b in raw]
    shots = [
        [p["image_url"]["url"].rsplit("/", 1)[1] for m in r if isinstance(m["content"], list)
         for p in m["content"] if p["type"] == "image_url"]
        for r in requests
    ]  # fmt: skip
    # Screenshot i.png is step i+1's; step 3 (no parsed reply) leaves the history, so step 5's
    # window of 3 is steps 2, 4 and the current 5.
    assert shots == [
        ["0.png"],
        ["0.png", "1.png"],
        ["0.png", "1.png"],
        ["0.png", "1.png", "2.png"],
        ["0.png", "1.png", "2.png"],
        ["0.png", "1.png", "2.png"],
        ["0.png", "1.png", "3.png"],
        ["1.png", "3.png", "4.png"],
    ]
    assistants = [m["content"] for m in requests[7] if m["role"] == "assistant"]
    assert assistants == [
        _canonical("click", coordinate=[166, 166]),
        _canonical("click", coordinate=[833, 166]),
        _canonical("click", coordinate=[500, 500]),
    ]
    executed = [e["action"] for e in events if e["type"] == "action_executed"]
    assert [a["name"] for a in executed] == ["tap", "tap", "invalid", "tap", "finished"]
    assert executed[1]["rawResult"]["ok"] is True, executed[1]
    calls = [e["step"] for e in events if e["type"] == "model_call"]
    assert calls == [1, 2, 2, 3, 3, 3, 4, 5]
    assert events[-1]["type"] == "run_end" and events[-1]["reason"] == "finished"


async def test_a_bad_context_is_refused_with_the_field(agent, gym, new_execution, spec_for):
    ex = await new_execution()
    body = spec_for(ex, model_options={"context": "window"}).body()
    async with httpx.AsyncClient(base_url=agent.url) as http:
        resp = await http.post("/runs", json=body)
    assert resp.status_code == 400 and "model.context" in resp.json()["error"]
