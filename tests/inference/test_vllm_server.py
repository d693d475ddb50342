"""cua_rl.inference.vllm_server against AReaL's own vLLM client payloads (real vLLM CPU)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.vllm_remote import VLLMBackend
from safetensors.torch import load_file, save_file

from cua_rl.cpu.training import KV_CACHE_BYTES
from cua_rl.gateway.backends import VLLMTokens
from cua_rl.inference import attach
from cua_rl.inference.vllm_server import OWN_FOLDER_PREFIX
from cua_rl.testing.vllm_server import free_port

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 33, 64, 101, 7]


def _root(server) -> str:
    return f"http://{server.host}:{server.port}"


async def _send(client: httpx.AsyncClient, req) -> httpx.Response:
    return await client.request(req.method, req.endpoint, json=req.payload)


async def _greedy(client, n_tokens: int = 6) -> tuple[list[int], list[float]]:
    backend = VLLMBackend()
    gconfig = GenerationHyperparameters(
        max_new_tokens=n_tokens, min_new_tokens=n_tokens, greedy=True
    )
    req = backend.build_generation_request(
        ModelRequest(input_ids=PROMPT, gconfig=gconfig), False, 0
    )
    resp = await _send(client, req)
    assert resp.status_code == 200, resp.text
    result = backend.parse_generation_response(resp.json())
    return result.output_tokens, result.output_logprobs


def _update(path) -> object:
    meta = WeightUpdateMeta(type="disk", path=str(path))
    (req,) = VLLMBackend().build_disk_weight_update_requests(meta).requests
    return req


def _transformers_logprobs(model_dir, tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture
def scaled_checkpoint(tmp_path, tiny_text_model_dir):
    # Same architecture, different weights: lm_head scaled by 3 sharpens every distribution.
    dst = tmp_path / "scaled"
    shutil.copytree(tiny_text_model_dir, dst)
    weights = load_file(dst / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


async def test_areal_generation_request_round_trips(areal_vllm_server, tiny_text_model_dir):
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=120) as client:
        tokens, logprobs = await _greedy(client)
    assert len(tokens) == len(logprobs) == 6
    expected = _transformers_logprobs(tiny_text_model_dir, tokens)
    assert logprobs == pytest.approx(expected, abs=2e-3)


async def test_pause_holds_completions_until_continue(areal_vllm_server):
    backend = VLLMBackend()
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=120) as client:
        paused = await _send(client, backend.get_pause_request())
        assert paused.status_code == 200 and paused.json()["success"] is True
        pending = asyncio.create_task(_greedy(client))
        try:
            await asyncio.sleep(2.0)
            assert not pending.done(), "a completion ran while generation was paused"
        finally:
            resumed = await _send(client, backend.get_resume_request())
        assert resumed.status_code == 200 and resumed.json()["success"] is True
        tokens, _ = await asyncio.wait_for(pending, 60)
    assert len(tokens) == 6


async def test_disk_update_loads_new_weights_and_back(
    areal_vllm_server, tiny_text_model_dir, scaled_checkpoint
):
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=120) as client:
        tokens0, logprobs0 = await _greedy(client)
        resp = await _send(client, _update(scaled_checkpoint))
        assert resp.status_code == 200, resp.text
        assert resp.json()["success"] is True
        tokens1, logprobs1 = await _greedy(client)
        # Served by the new weights: matches transformers on the scaled checkpoint.
        assert logprobs1 == pytest.approx(
            _transformers_logprobs(scaled_checkpoint, tokens1), abs=2e-3
        )
        assert logprobs1 != pytest.approx(logprobs0, abs=1e-2)
        resp = await _send(client, _update(tiny_text_model_dir))
        assert resp.status_code == 200, resp.text
        tokens2, logprobs2 = await _greedy(client)
    assert tokens2 == tokens0
    assert logprobs2 == pytest.approx(logprobs0, abs=1e-5)


@pytest.mark.parametrize("kind", ["missing", "no-weights", "relative"])
async def test_failed_update_is_a_400_and_the_server_keeps_serving(
    areal_vllm_server, tmp_path, kind
):
    if kind == "missing":
        path, needle = tmp_path / "no-such-checkpoint", "does not exist"
    elif kind == "no-weights":
        path, needle = tmp_path / "empty", "no *.safetensors"
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path, needle = "relative/ckpt", "not absolute"
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=120) as client:
        tokens0, logprobs0 = await _greedy(client)
        resp = await _send(client, _update(path))
        assert resp.status_code == 400
        body = resp.json()
        assert (
            body["success"] is False and needle in body["message"] and str(path) in body["message"]
        )
        tokens1, logprobs1 = await _greedy(client)
    assert tokens1 == tokens0
    assert logprobs1 == pytest.approx(logprobs0, abs=1e-5)


@pytest.mark.parametrize(
    "route", ["/areal_update_weights_xccl", "/areal_init_weights_update_group"]
)
async def test_nccl_routes_answer_how_to_fix(areal_vllm_server, route):
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=30) as client:
        resp = await client.post(route, json={})
    assert resp.status_code == 400
    assert "weight_update_mode=disk" in resp.json()["message"]


# -- a server lent to one training at a time (inference.server, cua_rl/inference/attach.py) -----


async def _tokens_in(server, n_tokens: int = 6) -> tuple[list[int], list[float], set[str]]:
    """Greedy on the tokens-in route the rollout gateway samples with: ids, logprobs and the
    versions its spans name (vLLM's "default" where no update labelled the weights)."""
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_tokens": n_tokens, "logprobs": 0},
        "return_token_ids": True,
        "model": str(server.model_dir),  # served under its path, as a training's is
    }
    async with httpx.AsyncClient(base_url=_root(server), timeout=120) as client:
        resp = await client.post("/inference/v1/generate", json=body)
    assert resp.status_code == 200, resp.text
    parsed = VLLMTokens().parse(resp.json())
    return parsed.output_ids, parsed.logprobs, {span["version"] for span in parsed.spans}


async def test_a_borrowed_server_serves_the_trainings_weights_to_one_training_at_a_time(
    areal_vllm_server, tiny_text_model_dir, scaled_checkpoint, tmp_path, monkeypatch
):
    address = f"{areal_vllm_server.host}:{areal_vllm_server.port}"
    ids0, lps0, spans0 = await _tokens_in(areal_vllm_server)
    assert spans0 == {"default"}  # a new server's weights carry no version label
    # What a previous training leaves: its last weights, labelled with their version.
    last = tmp_path / "ckpt" / "weight_update_v3"
    shutil.copytree(scaled_checkpoint, last)
    async with httpx.AsyncClient(base_url=_root(areal_vllm_server), timeout=120) as client:
        assert (await _send(client, _update(last))).json()["success"] is True
    _, lps1, spans1 = await _tokens_in(areal_vllm_server)
    assert lps1 != pytest.approx(lps0, abs=1e-2) and spans1 == {"3"}

    holder = attach.attach_process(address, str(tiny_text_model_dir))
    try:
        # The training's own weights, unlabelled, as on a new server.
        ids2, lps2, spans2 = await _tokens_in(areal_vllm_server)
        assert ids2 == ids0 and lps2 == pytest.approx(lps0, abs=1e-5) and spans2 == {"default"}
        # A second training is refused while the first holds the server, naming the holder.
        monkeypatch.setattr(attach, "BUSY_WAIT_S", 0.0)
        said = io.StringIO()
        assert attach.hold(address, str(tiny_text_model_dir), "second", out=said) == 2
        assert f"lent to another training (pid {os.getpid()}" in said.getvalue(), said.getvalue()
    finally:
        holder.kill()  # as a killed trainer's process group dies: no goodbye
        holder.wait()
    # Another model's checkpoint is refused whoever holds the server.
    said = io.StringIO()
    assert attach.hold(address, str(scaled_checkpoint), "wrong", out=said) == 2
    assert f"serves {tiny_text_model_dir}, not {scaled_checkpoint}" in said.getvalue()
    # The holder gone, the server is lent again (a refusal while its release is under way is
    # retried: the wait is for that state, BUSY_WAIT_S at most).
    monkeypatch.setattr(attach, "BUSY_WAIT_S", 60.0)
    again = attach.attach_process(address, str(tiny_text_model_dir))
    again.terminate()
    assert again.wait(10) == -signal.SIGTERM


def test_an_unreachable_server_is_named(tmp_path):
    port = free_port()
    with pytest.raises(attach.AttachError, match=f"127.0.0.1:{port} cannot be reached"):
        attach.attach_process(f"127.0.0.1:{port}", str(tmp_path))


def test_the_server_allocates_the_kv_cache_the_cpu_harness_sizes(
    areal_vllm_server, tiny_text_model_dir
):
    # vLLM CPU's smallest size through VLLM_CPU_KVCACHE_SPACE is 1 GiB, which the engine core
    # touches whole at start: a test suite's six servers at once held 6 GB of it and ran the
    # machine out of memory. The harness's bytes reach vLLM (its own count of the tokens they
    # hold: the tiny model's fp32 keys and values a token) and the engine stays small.
    text = json.loads((Path(tiny_text_model_dir) / "config.json").read_text())
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4
    tokens = KV_CACHE_BYTES // per_token
    assert f"CPU KV cache size: {tokens:,} tokens" in areal_vllm_server.log_path.read_text()
    processes = psutil.Process(areal_vllm_server.process.pid).children(recursive=True)
    (engine,) = [p for p in processes if "EngineCore" in " ".join(p.cmdline())]
    assert engine.memory_info().rss < 1 << 30, engine.memory_info()


def test_what_the_server_leaves_in_the_temp_folder_lives_in_its_own_folder_and_leaves_with_it(
    areal_vllm_server,
):
    # Last in this module: it stops the module's server. vLLM's ZeroMQ socket files went
    # straight into the temp folder and stayed there after the server stopped, and so did the
    # file its engine's torch group meets in (vllm_dist_<uuid>, one per launch).
    tmp = Path(areal_vllm_server.env["TMPDIR"])
    (own,) = tmp.glob(f"{OWN_FOLDER_PREFIX}*")
    assert any(p.is_socket() for p in own.iterdir()), list(own.iterdir())
    assert any(p.name.startswith("vllm_dist_") for p in own.iterdir()), list(own.iterdir())
    assert [p.name for p in tmp.iterdir()] == [own.name]
    areal_vllm_server.stop()
    assert list(tmp.iterdir()) == []
