"""Fixtures of the trajectory tests: event factories and event logs recorded from real runs.

``recorded_logs`` / ``bpe_logs`` run the local agent (``cua_rl/sim/agent/``) against the local
gym (``cua_rl/sim/gym.py``) with the session's real vLLM CPU server (tiny Qwen2-VL) as the model,
once per session, and keep the agent's event logs. Every execution is terminated and the gym is
checked for open executions afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
from datetime import UTC, datetime

import httpx
import pytest


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def solid_png(width: int, height: int, colour=(40, 120, 200)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


_ts = itertools.count(1_700_000_000_000)


def _event(**overrides) -> dict:
    """One agent event; ``type`` and ``step`` default to a step-1 step_start."""
    ev = {
        "type": "step_start",
        "ts": datetime.fromtimestamp(next(_ts) / 1000, UTC).isoformat(),
        "step": 1,
    }
    ev.update(overrides)
    return ev


def _model_output(prompt_ids, token_ids, logprobs=None, *, finish="stop", text="tap(1,2)"):
    """A vLLM chat-completion response with token ids and logprobs (docs/design.md, vLLM)."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
        "token_ids": token_ids,
    }
    if logprobs is not None:
        # Token strings are left empty on purpose: the converter must never read them.
        choice["logprobs"] = {
            "content": [{"token": "", "logprob": lp, "bytes": []} for lp in logprobs]
        }
    return {"id": "cmpl-x", "object": "chat.completion", "choices": [choice],
            "prompt_token_ids": prompt_ids}  # fmt: skip


def _turn_events(step, messages, output, action=None) -> list[dict]:
    evs = [
        _event(type="step_start", step=step),
        _event(type="model_call", step=step, modelSpecificInput={"messages": messages}),
        _event(type="model_output", step=step, modelOutput=output),
    ]
    if action is not None:
        evs.append(_event(type="action_executed", step=step, action=action, actionIndex=0))
    evs.append(_event(type="step_end", step=step))
    return evs


# ---- recording from real runs ------------------------------------------------------------------


@pytest.fixture(scope="session")
def agent_stack():
    """The local gym and the local agent on free loopback ports, for the whole session."""
    from cua_rl.sim.agent import AgentServer
    from cua_rl.sim.gym import GymServer

    with GymServer() as gym, AgentServer() as agent:
        yield gym, agent


async def record(stack, server, *, n=1, steps=4, seed=0, **model_options):
    """``n`` runs of the local agent on the local gym with ``server`` as the model (real HTTP)."""
    from cua_rl.testing.record import record_runs

    gym, agent = stack
    return await record_runs(
        gym.url,
        gym.gym_id,
        agent.url,
        server.base_url,
        server.model,
        n=n,
        steps=steps,
        seed=seed,
        model_options=model_options,
    )


def open_executions(stack) -> list:
    gym, _ = stack
    return httpx.get(f"{gym.base_url}/executions", timeout=30).json()["executions"]


@pytest.fixture(scope="session")
def recorded_runs(agent_stack, vllm_server):
    """Three 4-step runs of the byte-tokenizer model (ASCII-constrained, temperature 1.0)."""
    runs = asyncio.run(record(agent_stack, vllm_server, n=3, steps=4, constrain="ascii"))
    assert open_executions(agent_stack) == []
    assert all(r.status == "completed" for r in runs), [(r.status, r.reason) for r in runs]
    return runs


@pytest.fixture(scope="session")
def recorded_logs(recorded_runs):
    return [r.events for r in recorded_runs]


@pytest.fixture(scope="session")
def bpe_logs(agent_stack, vllm_bpe_server):
    """Runs of the BPE model sampled without constraint (prefix breaks expected)."""
    runs = asyncio.run(record(agent_stack, vllm_bpe_server, n=3, steps=4, maxTokens=16))
    assert open_executions(agent_stack) == []
    return [r.events for r in runs]


@pytest.fixture(scope="session")
def processor(tiny_vl_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_model_dir)


@pytest.fixture(scope="session")
def bpe_processor(tiny_vl_bpe_model_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)
