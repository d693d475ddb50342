"""One model call through AReaL's inference-engine semantics, tokens in and tokens out.

AReaL 1.0.4's ``RemoteInfEngine.agenerate`` waits while the rollout is paused for a weight
update, re-submits ``prompt + output so far`` when the server aborts a request for an update, and
tags tokens with the engine's version. For a VLM on vLLM it sends chat messages instead of ids,
re-sends the same messages after an abort and appends the second answer to the first (FACTS §7),
so it cannot be used for GUI episodes. This module keeps its semantics and sends ids: vLLM's
tokens-in endpoint (``POST /inference/v1/generate``, served with ``--enable-scale-out``) takes
the ids with one pad per image plus the images, expands the pads itself and returns the expanded
prompt, the sampled ids, their logprobs and which weight version sampled which tokens.

Versions: ``cua_rl.areal_ext.vllm_server`` labels each weight load with its AReaL version, so the
server's spans are exact; a server that does not (label ``default``) gets AReaL's own rule, the
engine's version when the answer came back.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from cua_rl.errors import ModelServerError
from cua_rl.gateway.config import Sampling
from cua_rl.gateway.render import BadRequest, Image
from cua_rl.logs import get_logger

log = get_logger("cua_rl.gateway.engine")

GENERATE_PATH = "/inference/v1/generate"
PAUSE_POLL_S = 0.2


class EngineView(Protocol):
    """What the gateway needs of AReaL's inference engine (thread-safe reads)."""

    def get_version(self) -> int: ...

    def is_paused(self) -> bool: ...

    def choose_server(self) -> str: ...


class AReaLEngineView:
    """``EngineView`` over AReaL's ``RemoteInfEngine`` (or the wrapper that holds one)."""

    def __init__(self, engine: Any):
        self.engine = getattr(engine, "_engine", engine)

    def get_version(self) -> int:
        return int(self.engine.get_version())

    def is_paused(self) -> bool:
        executor = getattr(self.engine, "_workflow_executor", None)
        return bool(executor is not None and executor.is_paused())

    def choose_server(self) -> str:
        return str(self.engine.choose_server())


@dataclass
class Generation:
    """One model call's result, as the model produced it."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    aborts: int = 0  # times a weight update cut the call and the rest was sampled again
    retries: int = 0  # times the server failed and the call was re-sent
    paused_s: float = 0.0  # time spent waiting for weight updates
    cut: int = 0  # a sampled vision token dropped from the end (see session.py)
    seconds: float = 0.0


def server_url(address: str) -> str:
    address = address.rstrip("/")
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def spans_to_versions(spans: Any, n: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's ``weight_versions`` spans; ``fallback`` where unlabelled."""
    versions = [fallback] * n
    for span in spans or ():
        try:
            v = int(span["version"])
            start, end = int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        for k in range(max(start, 0), min(end, n)):
            versions[k] = v
    return versions


def build_request(
    ids: list[int], images: list[Image], sampling: Sampling, max_tokens: int, model: str
) -> dict:
    body: dict[str, Any] = {
        "token_ids": ids,
        "sampling_params": sampling.vllm_params(max_tokens),
        "return_token_ids": True,
        "model": model,
    }
    if images:
        # The hash doubles as vLLM's multimodal cache key: a history image is processed once.
        body["content_parts"] = [
            {"type": "image_url", "url": img.data_url(), "uuid": img.sha256} for img in images
        ]
    return body


def parse_response(body: Any) -> tuple[list[int] | None, list[int], list[float], Any, str]:
    """(expanded prompt ids, sampled ids, logprobs, version spans, finish reason)."""
    try:
        choice = body["choices"][0]
        out = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        lps = [float(c["logprob"]) for c in content]
        prompt = body.get("prompt_token_ids")
        prompt = [int(t) for t in prompt] if prompt is not None else None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ModelServerError(f"malformed generate answer: {exc!r}", body=str(body)[:300]) from exc
    if len(lps) != len(out):
        raise ModelServerError(f"{len(out)} sampled ids but {len(lps)} logprobs")
    return (
        prompt,
        out,
        lps,
        choice.get("weight_versions"),
        str(choice.get("finish_reason") or "stop"),
    )


async def generate(
    client: httpx.AsyncClient,
    engine: EngineView,
    server: str,
    ids: list[int],
    images: list[Image],
    sampling: Sampling,
    *,
    max_tokens: int,
    model: str,
    timeout_s: float,
    retries: int,
) -> Generation:
    """Sample up to ``max_tokens`` after ``ids``; an abort or a dropped connection re-submits
    the prompt plus what was sampled so far, after any weight update in progress."""
    t0 = time.monotonic()
    gen: Generation | None = None
    out: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    aborts = failures = 0
    paused_s = 0.0
    finish = "abort"
    while finish == "abort" and len(out) < max_tokens:
        t_wait = time.monotonic()
        while engine.is_paused():
            await asyncio.sleep(PAUSE_POLL_S)
        paused_s += time.monotonic() - t_wait
        body = build_request(ids + out, images, sampling, max_tokens - len(out), model)
        try:
            resp = await client.post(
                f"{server_url(server)}{GENERATE_PATH}", json=body, timeout=timeout_s
            )
        except httpx.HTTPError as exc:
            failures += 1
            if failures > retries:
                raise ModelServerError(
                    f"model server {server}: {type(exc).__name__}: {exc}"
                ) from exc
            log.warning("model server %s: %r; re-sending (%d/%d)", server, exc, failures, retries)
            await asyncio.sleep(min(0.5 * 2 ** (failures - 1), 8.0))
            continue
        if resp.status_code >= 500:
            failures += 1
            if failures > retries:
                raise ModelServerError(
                    f"model server {server} answered {resp.status_code}: {resp.text[:300]}",
                    status=resp.status_code,
                )
            await asyncio.sleep(min(0.5 * 2 ** (failures - 1), 8.0))
            continue
        if resp.status_code != 200:
            raise BadRequest(
                f"model server refused the prompt: {resp.text[:500]}", code="model_refused"
            )
        try:
            answer = resp.json()
        except ValueError as exc:
            raise ModelServerError(f"model server {server} answered non-JSON") from exc
        prompt_ids, new, new_lps, spans, finish = parse_response(answer)
        if gen is None:
            if prompt_ids is None:
                raise ModelServerError("the generate answer has no prompt_token_ids")
            gen = Generation(prompt_ids=prompt_ids)
        out += new
        lps += new_lps
        versions += spans_to_versions(spans, len(new), engine.get_version())
        if finish == "abort":
            aborts += 1
    gen.output_ids, gen.logprobs, gen.versions = out, lps, versions
    # An abort that left no room is a call that ran out of tokens.
    gen.finish_reason = "length" if finish == "abort" else finish
    gen.aborts, gen.retries, gen.paused_s = aborts, failures, paused_s
    gen.seconds = time.monotonic() - t0
    return gen
