"""The gateway's requests to SGLang, checked against SGLang's documented ``/generate`` format.

No SGLang build runs on this machine, so the server here is a stand-in written from SGLang's
documentation (docs.sglang.io, "Sampling Parameters" / "Native APIs": ``input_ids``,
``image_data`` as base64 strings, ``sampling_params``, ``return_logprob``; the answer's
``meta_info.output_token_logprobs`` as ``[logprob, id, text]`` and ``finish_reason.type``) and
from AReaL 1.0.4's SGLang backend, which sends a VLM's prompt with every image pad already
expanded by the processor. It refuses any field outside that format, records every body, and
answers with ids the test chose. The gateway, its session and the processor are the real ones.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image as PILImage

from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
from cua_rl.gateway.backends import Request as Generate
from cua_rl.gateway.backends import SGLangTokens, VLLMText, with_images
from cua_rl.gateway.render import Image
from cua_rl.gateway.session import vision_token_ids
from cua_rl.serving import ThreadedServer
from cua_rl.trajectory.config import TrajectoryConfig
from tests.gateway.conftest import FakeEngine, data_url, png, user

REQUEST_FIELDS = {"input_ids", "image_data", "sampling_params", "return_logprob", "stream"}
SAMPLING_FIELDS = {
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "min_new_tokens",
    "stop_token_ids",
    "skip_special_tokens",
}


class SGLangStandIn:
    """``POST /generate`` per SGLang's documented format; ``script`` lists the answers to give,
    each ``(sampled ids, finish type)``."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.script: list[tuple[list[int], str]] = []
        self.app = FastAPI()
        self.app.post("/generate")(self.generate)

    async def generate(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        problems = sorted(set(body) - REQUEST_FIELDS)
        problems += sorted(set(body.get("sampling_params", {})) - SAMPLING_FIELDS)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            problems.append("input_ids must be a list of ints")
        for b64 in body.get("image_data", []):
            try:
                PILImage.open(io.BytesIO(base64.b64decode(b64, validate=True))).load()
            except Exception as exc:  # noqa: BLE001 - any decoding failure is a refusal
                problems.append(f"image_data: {exc}")
        if body.get("return_logprob") is not True or body.get("stream") is not False:
            problems.append("return_logprob must be true and stream false")
        if problems:
            return JSONResponse({"error": problems}, status_code=400)
        out, finish = self.script.pop(0)
        return {
            "text": "",
            "meta_info": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "output_token_logprobs": [[-0.25 - 0.01 * k, t, None] for k, t in enumerate(out)],
                "finish_reason": {"type": finish},
            },
        }


@pytest.fixture
def sglang():
    standin = SGLangStandIn()
    with ThreadedServer(standin.app, name="sglang-standin") as server:
        standin.address = server.url.removeprefix("http://")
        yield standin


def _rendered(processor, messages, images: list[bytes]) -> list[int]:
    """The prompt as AReaL's SGLang path builds it: the processor on the template's text."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pil = [PILImage.open(io.BytesIO(raw)).convert("RGB") for raw in images]
    out = processor(text=[text], images=pil or None, return_tensors="pt")
    return out["input_ids"][0].tolist()


async def test_sglang_requests_carry_expanded_ids_images_and_the_trainer_s_sampling(
    sglang, bpe_processor
):
    tok = bpe_processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gw = Gateway(GatewayConfig(backend="sglang")).start()
    engine = FakeEngine(sglang.address, version=7)
    sampling = Sampling(temperature=0.8, top_p=0.9, max_new_tokens=12)
    spec = SessionSpec(engine, sampling, bpe_processor, "policy", TrajectoryConfig())
    url = gw.open("ep", spec)
    shots = [png((10, 20, 30)), png((200, 10, 10), size=(128, 96))]
    first = tok.encode("tap(1, 2)", add_special_tokens=False) + [im_end]
    cut, rest = (
        tok.encode("back", add_special_tokens=False),
        tok.encode("()", add_special_tokens=False),
    )
    sglang.script = [(first, "stop"), (cut, "abort"), (rest + [im_end], "stop")]
    messages = [
        {"role": "system", "content": "You operate a phone."},
        user("Go", data_url(shots[0])),
    ]
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            r1 = await http.post(f"{url}/chat/completions", json={"messages": messages})
            assert r1.status_code == 200, r1.text
            messages += [r1.json()["choices"][0]["message"], user("Next", data_url(shots[1]))]
            r2 = await http.post(f"{url}/chat/completions", json={"messages": messages})
            assert r2.status_code == 200, r2.text
    finally:
        capture = gw.close("ep")
        gw.stop()
    assert r2.json()["choices"][0]["message"]["content"] == "back()"
    b1, b2, b3 = sglang.bodies
    # Turn 1: the processor's own expansion of the rendered conversation, the image's bytes.
    template = [
        {"role": "system", "content": "You operate a phone."},
        {"role": "user", "content": [{"type": "text", "text": "Go"}, {"type": "image"}]},
    ]
    assert b1["input_ids"] == _rendered(bpe_processor, template, shots[:1])
    assert [base64.b64decode(s) for s in b1["image_data"]] == shots[:1]
    params = b1["sampling_params"]
    assert (params["temperature"], params["top_p"], params["max_new_tokens"]) == (0.8, 0.9, 12)
    # A sampled vision token would end the reply (the session's rule for every backend).
    assert set(vision_token_ids(tok)) <= set(params["stop_token_ids"])
    # Turn 2 extends turn 1's ids; here the sampled ids are canonical, so they also equal a
    # full render of the conversation by the processor (the pads of both images included).
    template += [
        {"role": "assistant", "content": "tap(1, 2)"},
        {"role": "user", "content": [{"type": "text", "text": "Next"}, {"type": "image"}]},
    ]
    assert b2["input_ids"][: len(b1["input_ids"]) + len(first)] == b1["input_ids"] + first
    assert b2["input_ids"] == _rendered(bpe_processor, template, shots)
    assert [base64.b64decode(s) for s in b2["image_data"]] == shots
    # The abort: the prompt plus what was sampled is sent again, for the tokens still allowed.
    assert b3["input_ids"] == b2["input_ids"] + cut
    assert b3["sampling_params"]["max_new_tokens"] == 12 - len(cut)
    t1, t2 = capture.turns
    assert t1.prompt_ids == b1["input_ids"] and t1.output_ids == first
    assert t2.prompt_ids == b2["input_ids"] and t2.output_ids == cut + rest + [im_end]
    assert t2.aborts == 1 and t2.backend == "sglang" and t2.segment == 1
    assert t2.logprobs[: len(cut)] == pytest.approx([-0.25 - 0.01 * k for k in range(len(cut))])
    assert set(t2.versions) == {7}  # no spans from SGLang: the engine's version (AReaL's rule)


def test_sglang_answers_parse_and_malformed_ones_are_refused():
    backend = SGLangTokens()
    ok = {
        "meta_info": {
            "output_token_logprobs": [[-0.5, 11, "a"], [-1.5, 12, "b"]],
            "finish_reason": {"type": "length", "length": 2},
        }
    }
    parsed = backend.parse(ok)
    assert (parsed.output_ids, parsed.logprobs, parsed.finish_reason) == (
        [11, 12],
        [-0.5, -1.5],
        "length",
    )
    assert parsed.prompt_ids is None and parsed.spans is None
    from cua_rl.errors import ModelServerError

    with pytest.raises(ModelServerError, match="malformed SGLang answer"):
        backend.parse({"text": "no meta"})
    with pytest.raises(ModelServerError, match="malformed SGLang answer"):
        backend.parse({"meta_info": {"output_token_logprobs": [["x", 1, None]]}})


def test_text_backend_puts_each_image_back_where_its_placeholder_was():
    a, b = Image.of(png((1, 2, 3)), "a"), Image.of(png((4, 5, 6)), "b")
    template = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]},
        {"role": "assistant", "content": "r"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "y"}]},
    ]
    msgs = with_images(template, [a, b])
    assert msgs[1]["content"][1] == {"type": "image_url", "image_url": {"url": a.data_url()}}
    assert msgs[3]["content"][0] == {"type": "image_url", "image_url": {"url": b.data_url()}}
    body = VLLMText().body(Generate([], [a, b], template, Sampling(temperature=0.5), 8, "m"))
    assert body["messages"] == msgs and body["logprobs"] is True and body["max_tokens"] == 8
    assert body["temperature"] == 0.5 and body["return_token_ids"] is True


async def test_only_a_missing_route_means_no_tokens_in():
    """404 for an unknown model is the agent's (or config's) error, not a reason for text in."""
    from cua_rl.gateway.engine import TokensInUnavailable, generate
    from cua_rl.gateway.render import BadRequest

    answers = {
        "route": httpx.Response(404, json={"detail": "Not Found"}),
        "model": httpx.Response(404, json={"error": {"message": "The model `x` does not exist."}}),
    }
    for kind, answer in answers.items():
        transport = httpx.MockTransport(lambda request, a=answer: a)
        async with httpx.AsyncClient(transport=transport) as client:
            want = TokensInUnavailable if kind == "route" else BadRequest
            with pytest.raises(want):
                await generate(
                    client, FakeEngine("s:1"), "s:1", [1, 2], [], Sampling(),
                    max_tokens=4, model="x", timeout_s=5, outage_s=1.0,
                )  # fmt: skip
