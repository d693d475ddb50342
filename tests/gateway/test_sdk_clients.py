"""The official OpenAI SDKs as GUI agents use them, through the gateway to a real vLLM CPU server.

Each SDK re-sends an identical request after its own timeout. A pause held by the test (the
rollout paused for a weight update) makes every attempt of one step time out, by construction;
the agent then sends the step again once the pause is over. The capture must hold exactly the
turns the agent received, in one segment, and the row must be what the model computes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from cua_rl.testing.forward import load_vl_model, trained_gap
from tests.gateway.conftest import data_url, png, row_of, user

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NPM_OPENAI = "6.49.0"  # the version a TypeScript agent such as gbox-mini-agent ships with
SYSTEM = {"role": "system", "content": "You operate a phone."}


def shot(n: int) -> str:
    return data_url(png((40 * n, 200 - 30 * n, 90)))


def check_capture(capture, received: list[str], processor, model_dir) -> dict:
    """The capture holds the received turns only, in one segment, and the row reproduces."""
    assert [t.response_id for t in capture.turns] == received
    assert {t.segment for t in capture.turns} == {1}
    stats = capture.stats()
    assert stats["gateway/new_segments"] == 0
    row = row_of(capture, processor, len(received))
    assert trained_gap(load_vl_model(model_dir), row).max().item() < 1e-3
    return stats


async def test_python_sdk_retries_across_a_pause_commit_only_what_the_agent_received(
    open_episode, gateway, bpe_processor, tiny_vl_bpe_model_dir
):
    episode, url, engine = open_episode()
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    messages: list[dict] = [SYSTEM]
    received: list[str] = []

    async def step(**options):
        r = await client.with_options(**options).chat.completions.create(
            model="policy", messages=messages
        )
        received.append(r.id)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))

    messages.append(user("Step 1", shot(1)))
    await step()
    messages.append(user("Step 2", shot(2)))
    engine.paused.set()
    # The pause lasts until the SDK gave up: its first attempt and both retries time out.
    with pytest.raises(openai.APITimeoutError):
        await step(timeout=1.0, max_retries=2)
    engine.paused.clear()
    await step()  # the agent's own re-send of step 2, identical
    messages.append(user("Step 3", shot(3)))
    await step()
    await client.close()

    stats = check_capture(gateway.close(episode), received, bpe_processor, tiny_vl_bpe_model_dir)
    # Three attempts left; each later one (2 retries + the agent's) joined the same generation.
    assert stats["gateway/disconnects"] == 3 and stats["gateway/resends"] == 3
    assert stats["gateway/discarded_generations"] == 0


async def test_an_abandoned_call_followed_by_a_different_one_commits_nothing(open_episode, gateway):
    episode, url, engine = open_episode()
    engine.paused.set()
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{url}/chat/completions", json={"messages": [user("a")]}, timeout=0.5)
        engine.paused.clear()
        r = await http.post(f"{url}/chat/completions", json={"messages": [user("b")]}, timeout=120)
    assert r.status_code == 200, r.text
    capture = gateway.close(episode)
    assert [t.response_id for t in capture.turns] == [r.json()["id"]]
    stats = capture.stats()
    assert stats["gateway/disconnects"] == 1 and stats["gateway/discarded_generations"] == 1
    assert stats["gateway/segments"] == 1


async def test_an_identical_request_after_a_delivered_answer_is_sampled_again(
    open_episode, gateway
):
    """An agent re-asks what did not parse: a new call. Only an SDK retry (its retry count > 0)
    gets the stored answer."""
    episode, url, _ = open_episode()
    body = {"messages": [user("a", shot(1))]}
    async with httpx.AsyncClient(timeout=120) as http:
        first = await http.post(f"{url}/chat/completions", json=body)
        reask = await http.post(f"{url}/chat/completions", json=body)
        retried = await http.post(
            f"{url}/chat/completions", json=body, headers={"x-stainless-retry-count": "1"}
        )
    assert first.status_code == reask.status_code == retried.status_code == 200
    assert reask.json()["id"] != first.json()["id"] and retried.json() == reask.json()
    capture = gateway.close(episode)
    assert [t.response_id for t in capture.turns] == [first.json()["id"], reask.json()["id"]]
    assert capture.turns[1].prompt_ids == capture.turns[0].prompt_ids
    stats = capture.stats()
    assert stats["gateway/reasks"] == 1 and stats["gateway/resends"] == 1


@pytest.fixture(scope="session")
def npm_openai() -> Path:
    """The official npm package, installed from the npm registry into a git-ignored folder."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the npm SDK cannot run")
    prefix = REPO / ".cache" / f"npm-openai-{NPM_OPENAI}"
    manifest = prefix / "node_modules" / "openai" / "package.json"
    if not manifest.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(prefix)]
            + [f"openai@{NPM_OPENAI}"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    assert json.loads(manifest.read_text())["version"] == NPM_OPENAI
    return prefix


class NodeAgent:
    """tests/gateway/openai_agent.cjs in a node process, one JSON step per line."""

    def __init__(self, proc):
        self.proc = proc

    @classmethod
    async def start(cls, base_url: str, package: Path) -> NodeAgent:
        proc = await asyncio.create_subprocess_exec(
            "node",
            str(Path(__file__).with_name("openai_agent.cjs")),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "BASE_URL": base_url, "OPENAI_NODE_DIR": str(package)},
        )
        return cls(proc)

    async def step(self, **spec) -> dict:
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        assert line, "the node agent exited"
        return json.loads(line)

    async def stop(self) -> None:
        self.proc.stdin.close()
        await self.proc.wait()


async def test_npm_sdk_retries_across_a_pause_commit_only_what_the_agent_received(
    open_episode, gateway, bpe_processor, tiny_vl_bpe_model_dir, npm_openai
):
    episode, url, engine = open_episode()
    agent = await NodeAgent.start(url, npm_openai)
    try:
        one = await agent.step(text="Step 1", image=shot(1))
        engine.paused.set()
        timed_out = await agent.step(text="Step 2", image=shot(2), timeout_ms=1000, max_retries=2)
        engine.paused.clear()
        two = await agent.step(resend=True)
        three = await agent.step(text="Step 3", image=shot(3))
    finally:
        await agent.stop()
    assert timed_out == {"error": "APIConnectionTimeoutError"}
    received = [one["id"], two["id"], three["id"]]
    stats = check_capture(gateway.close(episode), received, bpe_processor, tiny_vl_bpe_model_dir)
    assert stats["gateway/disconnects"] == 3 and stats["gateway/resends"] == 3
    assert stats["gateway/discarded_generations"] == 0
