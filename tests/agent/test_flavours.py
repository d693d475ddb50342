"""The local agent's mai-ui and qwen3-vl flavours read replies written as the released models
write them, and a run driven by such replies executes on the sim gym over real HTTP (a scripted
OpenAI-compatible model server stands in for the checkpoint)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request

from cua_rl.agent.actions import ActionParseError
from cua_rl.agent.flavours import get_flavour
from cua_rl.serving import ThreadedServer

W, H = 360, 640


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _mai(**arguments) -> str:
    return "<thinking>\nThe switch is at the top.\n</thinking>\n" + _call("mobile_use", **arguments)


MAI_CASES = [
    (_mai(action="click", coordinate=[999, 0]), "tap", {"x": 359, "y": 0}),
    (_mai(action="long_press", coordinate=[500, 500]), "tap", {"x": 180, "y": 320}),
    (_mai(action="type", text="hello"), "type", {"text": "hello"}),
    (
        _mai(action="swipe", direction="up", coordinate=[500, 750]),
        "swipe",
        {"x1": 180, "y1": 480, "x2": 180, "y2": 267},
    ),
    (
        _mai(action="drag", start_coordinate=[0, 0], end_coordinate=[999, 999]),
        "swipe",
        {"x1": 0, "y1": 0, "x2": 359, "y2": 639},
    ),
    (_mai(action="system_button", button="back"), "back", {}),
    (_mai(action="system_button", button="enter"), "key", {"key": "enter"}),
    (_mai(action="open", text="Settings"), "open", {"app": "Settings"}),
    (_mai(action="wait"), "wait", {"seconds": 1.0}),
    (_mai(action="answer", text="42"), "finished", {"text": "42"}),
    (_mai(action="terminate", status="success"), "finished", {"text": "", "status": "success"}),
    (_mai(action="ask_user", text="Which account?"), "ask_user", {"text": "Which account?"}),
    (
        "<thinking>\nLook it up.\n</thinking>\n" + _call("weather", city="Hangzhou"),
        "mcp_call",
        {"tool": "weather", "arguments": {"city": "Hangzhou"}},
    ),
]


@pytest.mark.parametrize(("reply", "name", "params"), MAI_CASES)
def test_mai_ui_replies_become_actions(reply, name, params):
    action = get_flavour("mai-ui").read_reply(reply, W, H)
    assert (action.name, action.params) == (name, params)


QWEN_CASES = [
    (_call("mobile_use", action="click", coordinate=[0, 999]), "tap", {"x": 0, "y": 639}),
    (
        _call("mobile_use", action="swipe", coordinate=[500, 800], coordinate2=[500, 200]),
        "swipe",
        {"x1": 180, "y1": 512, "x2": 180, "y2": 128},
    ),
    (_call("mobile_use", action="key", text="volume_up"), "key", {"key": "volume_up"}),
    (_call("mobile_use", action="system_button", button="Home"), "home", {}),
    (_call("mobile_use", action="wait", time=2), "wait", {"seconds": 2.0}),
    (
        _call("mobile_use", action="terminate", status="failure"),
        "finished",
        {"text": "", "status": "failure"},
    ),
    (
        _call("computer_use", action="left_click", coordinate=[500, 500]),
        "tap",
        {"x": 180, "y": 320},
    ),
    (_call("computer_use", action="key", keys=["ctrl", "Enter"]), "key", {"key": "enter"}),
    (
        _call("computer_use", action="scroll", pixels=-300),
        "swipe",
        {"x1": 180, "y1": 320, "x2": 180, "y2": 106},
    ),
]


@pytest.mark.parametrize(("reply", "name", "params"), QWEN_CASES)
def test_qwen3_vl_replies_become_actions(reply, name, params):
    action = get_flavour("qwen3-vl").read_reply("I will act.\n" + reply, W, H)
    assert (action.name, action.params) == (name, params)


@pytest.mark.parametrize("flavour", ["mai-ui", "qwen3-vl"])
@pytest.mark.parametrize(
    ("reply", "says"),
    [
        ("tap(3, 4)", "no <tool_call>"),
        ("<tool_call>\n{not json}\n</tool_call>", "not JSON"),
        (_call("mobile_use", action="click", coordinate=[1200, 5]), "outside the 0-999"),
        (_call("mobile_use", action="click", coordinate="5,5"), "coordinate must be"),
        (_call("mobile_use", action="fly"), "unknown mobile_use action"),
    ],
)
def test_malformed_calls_say_what_is_wrong(flavour, reply, says):
    with pytest.raises(ActionParseError, match=says):
        get_flavour(flavour).read_reply(reply, W, H)


def test_lenient_reading_taps_the_grid_cell_of_a_reply_with_no_call():
    action = get_flavour("mai-ui").read_reply("zzz", W, H, lenient=True)
    assert action.name == "tap"  # 'z' is 122, cell 122 % 9 = 5: middle row, right column
    assert action.params == {"x": 300, "y": 320}


def test_prompts_declare_the_formats():
    mai = get_flavour("mai-ui").prompt([{"name": "weather", "parameters": {}}])
    assert '"name": "mobile_use"' in mai and "<thinking>" in mai and '"ask_user"' in mai
    assert '{"name": "weather", "parameters": {}}' in mai
    qwen = get_flavour("qwen3-vl").prompt(None)
    tools = qwen.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    declared = json.loads(tools)
    assert declared["function"]["name"] == "mobile_use"
    assert "click" in declared["function"]["parameters"]["properties"]["action"]["enum"]


def _scripted_model(replies: list[str]) -> FastAPI:
    app = FastAPI()
    seen: list[dict] = []
    app.state.seen = seen

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        seen.append(body)
        text = replies[min(len(seen) - 1, len(replies) - 1)]
        return {"choices": [{"message": {"role": "assistant", "content": text}}]}

    return app


async def _events(agent_url: str, body: dict) -> list[dict]:
    async with httpx.AsyncClient(base_url=agent_url, timeout=30) as http:
        run_id = (await http.post("/runs", json=body)).json()["runId"]
        for _ in range(1200):  # up to a minute: a bound for a hung run, not its speed
            run = (await http.get(f"/runs/{run_id}")).json()
            if run["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)  # polling a finished run's status, not racing it
        return (await http.get(f"/runs/{run_id}/events")).json()["events"]


async def test_a_mai_ui_run_executes_on_the_gym(agent, gym, new_execution, spec_for):
    replies = [
        _mai(action="click", coordinate=[500, 500]),
        _mai(action="ask_user", text="Which network?"),
        "<thinking>\nCheck.\n</thinking>\n" + _call("weather", city="Hangzhou"),
        _mai(action="answer", text="done"),
    ]
    app = _scripted_model(replies)
    with ThreadedServer(app) as model:
        ex = await new_execution()
        body = spec_for(
            ex,
            model_base_url=f"{model.url}/v1",
            max_steps=6,
            model_options={"flavour": "mai-ui", "logprobs": False},
        ).body()
        events = await _events(agent.url, body)
    executed = [e["action"] for e in events if e["type"] == "action_executed"]
    assert [a["name"] for a in executed] == ["tap", "ask_user", "mcp_call", "finished"]
    # The gym evaluated the tap (its answer names the screen it landed on).
    assert executed[0]["args"] == {"point": {"x": 180, "y": 320}}
    assert executed[0]["rawResult"]["screen"] == "home", executed[0]
    assert executed[1]["rawResult"]["reply"]
    assert "no MCP server" in executed[2]["rawResult"]["error"]
    assert executed[3]["args"] == {"content": "done"}
    end = events[-1]
    assert end["type"] == "run_end" and end["reason"] == "finished"
    system = app.state.seen[0]["messages"][0]
    assert system["role"] == "system" and '"name": "mobile_use"' in system["content"]


async def test_a_lenient_run_reads_replies_on_the_configured_grid(
    agent, gym, new_execution, spec_for
):
    # 'u' (117) names cell 17 of a 10x10 grid (row 1, column 7): (270, 96) on a 360x640 screen,
    # where the default 3x3 grid would tap cell 0 (117 % 9), (60, 106).
    app = _scripted_model(["uuu"])
    with ThreadedServer(app) as model:
        ex = await new_execution()
        body = spec_for(
            ex,
            model_base_url=f"{model.url}/v1",
            max_steps=1,
            model_options={"parse": "lenient", "lenientGrid": 10, "logprobs": False},
        ).body()
        events = await _events(agent.url, body)
    executed = [e["action"] for e in events if e["type"] == "action_executed"]
    assert [a["args"] for a in executed] == [{"point": {"x": 270, "y": 96}}]


@pytest.mark.parametrize("grid", [0, "10", True])
def test_a_bad_lenient_grid_is_refused(grid):
    from cua_rl.agent.run import BadRunRequest, validate_run_body

    body = {
        "task": "t",
        "maxSteps": 1,
        "model": {"baseUrl": "http://127.0.0.1/v1", "name": "m", "lenientGrid": grid},
        "env": {"type": "genv", "gymBaseUrl": "http://127.0.0.1", "gymId": "g", "executionId": "e"},
    }
    with pytest.raises(BadRunRequest, match="lenientGrid must be an integer >= 1"):
        validate_run_body(body)
