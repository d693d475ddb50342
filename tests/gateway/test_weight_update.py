"""A weight update lands in the middle of a model call: the agent gets a normal answer and every
token carries the version that sampled it, checked against both models' own logprobs."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from cua_rl.cpu.vllm_server import OUR_EXTENSION
from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.testing.forward import load_vl_model, next_token_logprobs
from cua_rl.testing.vllm_server import VLLMServer
from cua_rl.trajectory import convert_turns
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, data_url, png, user

pytestmark = pytest.mark.slow

N_TOKENS = 1500


def _metric(text: str, name: str) -> float:
    """Sum of one Prometheus series over its labels (0 when the server has not reported it)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _wait_until_sampling(http: httpx.AsyncClient, root: str, since: float, call) -> None:
    """Return once vLLM reports the call running with tokens already sampled.

    The update is sent on that signal, not after a fixed delay: the call is then in flight and
    has output, whatever this machine's sampling speed (polled every 10 ms, far below the time
    the 1500-token call takes even on a fast server)."""
    while not call.done():
        text = (await http.get(f"{root}/metrics")).text
        running = _metric(text, "vllm:num_requests_running")
        if running >= 1 and _metric(text, "vllm:generation_tokens_total") > since:
            return
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def server(tiny_vl_bpe_model_dir):
    # Its own server: the weight labels it gets here must not reach other tests.
    extra = ["--worker-extension-cls", OUR_EXTENSION]
    with VLLMServer(
        tiny_vl_bpe_model_dir, model="tiny-vl-bpe-upd", extra_args=extra, log_stats=True
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def sharper_v1(tmp_path_factory, tiny_vl_bpe_model_dir):
    """Version 1 of the policy, saved where AReaL saves it: .../weight_update_v1."""
    dst = tmp_path_factory.mktemp("ckpt") / "weight_update_v1"
    shutil.copytree(tiny_vl_bpe_model_dir, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2.0  # sharper distributions
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


async def test_weight_update_mid_call_gives_a_normal_answer_and_both_versions(
    server, sharper_v1, tiny_vl_bpe_model_dir
):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)
    engine = FakeEngine(f"{server.host}:{server.port}", version=0)
    gw = Gateway(GatewayConfig()).start()
    # min_new_tokens = max_new_tokens keeps the model from stopping early, so the call is long.
    sampling = Sampling(temperature=1.0, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS)
    spec = SessionSpec(engine, sampling, processor, server.model, TrajectoryConfig())
    url = gw.open("upd", spec)
    root = f"http://{server.host}:{server.port}"
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            messages = [user("Step 1", data_url(png()))]
            since = _metric(
                (await http.get(f"{root}/metrics")).text, "vllm:generation_tokens_total"
            )
            call = asyncio.create_task(
                http.post(f"{url}/chat/completions", json={"messages": messages})
            )
            await _wait_until_sampling(http, root, since, call)
            assert not call.done(), "the call ended before vLLM reported it sampling"
            # AReaL's order: pause the rollout, abort in-flight generation, load the new
            # weights, publish the version, resume.
            engine.paused.set()
            r = await http.post(f"{root}/areal_pause_generation", json={})
            assert r.status_code == 200, r.text
            r = await http.post(
                f"{root}/areal_update_weights", json={"model_path": str(sharper_v1)}
            )
            assert r.status_code == 200, r.text
            engine.version = 1
            r = await http.post(f"{root}/areal_continue_generation", json={})
            assert r.status_code == 200
            engine.paused.clear()
            answer = await call
        capture = gw.close("upd")
    finally:
        gw.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    (turn,) = capture.turns
    assert turn.aborts == 1 and not capture.errors
    assert len(turn.output_ids) == N_TOKENS
    k = turn.versions.index(1)
    assert 0 < k < N_TOKENS
    assert turn.versions == [0] * k + [1] * (N_TOKENS - k)

    result = convert_turns(
        capture.row_turns([]), processor=processor, reward=0.0, version=-5,
        fetched_images=capture.images(),
    )  # fmt: skip
    assert result.ok, (result.reason, result.detail)
    row = result.row
    trained = row["loss_mask"][0].nonzero().flatten()
    versions = row["versions"][0, trained]
    assert versions.tolist() == turn.versions
    recorded = row["logprobs"][0, trained]
    stops = sorted({0, 2, *(processor.tokenizer.convert_tokens_to_ids(t) for t in (
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))})  # fmt: skip
    # While min_tokens is not reached (every position here) vLLM removes the stop tokens.
    old = next_token_logprobs(load_vl_model(tiny_vl_bpe_model_dir), row, banned=stops)[trained]
    new = next_token_logprobs(load_vl_model(sharper_v1), row, banned=stops)[trained]
    before, after = versions == 0, versions == 1
    assert (recorded[before] - old[before]).abs().max() < 1e-3
    assert (recorded[after] - new[after]).abs().max() < 1e-3
    # And each part is far from the other model: the attribution is not a coincidence.
    assert (recorded[after] - old[after]).abs().mean() > 0.05
