"""A weight update lands in the middle of a model call: the agent gets a normal answer and every
token carries the version that sampled it, checked against both models' own logprobs."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.inference.vllm_server import OUR_EXTENSION
from cua_rl.testing.forward import load_vl_model, next_token_logprobs
from cua_rl.testing.hold import Hold
from cua_rl.testing.vllm_server import VLLMServer
from cua_rl.trajectory import captured, convert_turns
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, data_url, png, user

pytestmark = pytest.mark.slow

N_TOKENS = 200
# Where the pause lands: right after the first token, and late in the call. The server is held
# there (cua_rl.testing.hold) until the pause reaches it, so neither depends on sampling speed.
HOLDS = (1, 150)


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    return Hold(tmp_path_factory.mktemp("hold"))


@pytest.fixture(scope="module")
def server(tiny_vl_bpe_model_dir, hold):
    # Its own server: the weight labels it gets here must not reach other tests.
    extra = ["--worker-extension-cls", OUR_EXTENSION, *hold.server_args()]
    with VLLMServer(
        tiny_vl_bpe_model_dir, model="tiny-vl-bpe-upd", extra_args=extra, env=hold.env()
    ) as srv:
        yield srv


def _version(tmp_path_factory, src, v: int):
    """A copy of ``src`` saved where AReaL saves version ``v``: .../weight_update_v{v}."""
    dst = tmp_path_factory.mktemp("ckpt") / f"weight_update_v{v}"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def base_v0(tmp_path_factory, tiny_vl_bpe_model_dir):
    return _version(tmp_path_factory, tiny_vl_bpe_model_dir, 0)


@pytest.fixture(scope="module")
def sharper_v1(tmp_path_factory, tiny_vl_bpe_model_dir):
    """Version 1 of the policy, saved where AReaL saves it: .../weight_update_v1."""
    dst = _version(tmp_path_factory, tiny_vl_bpe_model_dir, 1)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2.0  # sharper distributions
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("hold_at", HOLDS)
async def test_weight_update_mid_call_gives_a_normal_answer_and_both_versions(
    server, hold, hold_at, base_v0, sharper_v1, tiny_vl_bpe_model_dir
):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_bpe_model_dir)
    engine = FakeEngine(f"{server.host}:{server.port}", version=0)
    gw = Gateway(GatewayConfig()).start()
    # min_new_tokens = max_new_tokens keeps the model from stopping early.
    sampling = Sampling(temperature=1.0, max_new_tokens=N_TOKENS, min_new_tokens=N_TOKENS)
    spec = SessionSpec(engine, sampling, processor, server.model, TrajectoryConfig())
    url = gw.open("upd", spec)
    root = f"http://{server.host}:{server.port}"
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            # Version 0 again, labelled 0 (an earlier case loaded version 1).
            r = await http.post(f"{root}/areal_update_weights", json={"model_path": str(base_v0)})
            assert r.status_code == 200, r.text
            hold.arm(hold_at)
            messages = [user("Step 1", data_url(png()))]
            call = asyncio.create_task(
                http.post(f"{url}/chat/completions", json={"messages": messages})
            )
            # The server stops sampling at hold_at tokens and resumes only once the pause
            # below has reached its engine, which then aborts the call before its next step.
            assert await hold.held(call) == hold_at
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
    # The held step sampled one more token under version 0; the pause aborted the rest.
    k = turn.versions.index(1)
    assert k == hold_at + 1
    assert turn.versions == [0] * k + [1] * (N_TOKENS - k)

    result = convert_turns(
        captured.row_turns(capture, []), processor=processor, reward=0.0, version=-5,
        fetched_images=captured.images(capture),
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
