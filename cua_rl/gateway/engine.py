"""One model call through AReaL's inference-engine semantics, tokens in and tokens out.

AReaL 1.0.4's ``RemoteInfEngine.agenerate`` waits while the rollout is paused for a weight
update, re-submits ``prompt + output so far`` when the server aborts a request for an update, and
tags tokens with the engine's version. For a VLM on vLLM it sends chat messages instead of ids,
re-sends the same messages after an abort and appends the second answer to the first,
so it cannot be used for GUI episodes. This module keeps its semantics and sends ids: vLLM's
tokens-in endpoint (``POST /inference/v1/generate``, served with ``--enable-scale-out``) takes
the ids with one pad per image plus the images, expands the pads itself and returns the expanded
prompt, the sampled ids, their logprobs and which weight version sampled which tokens. Other
servers' requests are in ``backends`` (SGLang's ``/generate``; text in as a fallback).

Every wait is bounded: a pause by a bound derived from this run's pauses (``pauses``: AReaL
tells the rollout side nothing about a weight update that failed or hangs), aborts with no token
and no pause by ``gateway.max_aborts``. A model
server that refuses, drops or answers 5xx is an outage, not an error: the call is held and re-sent
with a growing backoff (capped at ``OUTAGE_BACKOFF_CAP_S``) until ``gateway.model_outage_s``, as
it is held across a weight update; an answer cut on the wire was never received, so the re-send
samples what the agent gets and what is trained, once.

Versions: ``cua_rl.inference.vllm_server`` labels each weight load with its AReaL version, so the
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
from cua_rl.gateway.backends import Request, VLLMTokens
from cua_rl.gateway.config import GatewayConfig, Sampling
from cua_rl.gateway.model_outages import Outages
from cua_rl.gateway.render import BadRequest, Image
from cua_rl.gateway.weight_pauses import PauseBound, WeightPauses

PAUSE_POLL_S = 0.2
OUTAGE_BACKOFF_CAP_S = 10.0  # longest gap between two re-sends: a restarted server is found soon


class TokensInUnavailable(ModelServerError):
    """The server has no tokens-in endpoint (404/405): the session falls back to text in."""


class WaitFailed(ModelServerError):
    """A call the gateway stopped waiting for: ``code`` names why (``pause_timeout``: the pause
    outlasted its bound, see ``pauses``; ``abort_loop``: the server aborted it
    ``gateway.max_aborts`` times in a row with no pause and no token)."""

    def __init__(self, message: str, code: str, waited_s: float = 0.0):
        super().__init__(message)
        self.code, self.waited_s = code, waited_s


class ModelOutage(ModelServerError):
    """The model server stayed unavailable past ``gateway.model_outage_s``."""

    def __init__(self, message: str, outage_s: float, retries: int):
        super().__init__(message)
        self.outage_s, self.retries = outage_s, retries


class EngineView(Protocol):
    """What the gateway needs of AReaL's inference engine (thread-safe reads), and the record of
    its pauses that every episode on it shares."""

    pauses: WeightPauses

    def get_version(self) -> int: ...

    def is_paused(self) -> bool: ...

    def choose_server(self) -> str: ...


async def wait_while_paused(engine: EngineView, bound: PauseBound) -> float:
    """Wait for the rollout to resume; the seconds this call waited. Fails once the pause (since
    the first call found it) is older than its bound, derived from the run's longest pause."""
    t0 = time.monotonic()
    pauses = engine.pauses
    while engine.is_paused():
        age = pauses.paused_for()
        limit, why = bound.of(pauses.longest_s)
        if age > limit:
            raise WaitFailed(
                f"the rollout stayed paused {age:.1f} s, past its bound of {why}: the weight "
                "update (or the save or evaluation after it) is stuck or failed on the "
                "trainer's side; raise gateway.min_pause_wait_s or gateway.pause_wait_factor if "
                "this run's pauses vary more",
                "pause_timeout",
                time.monotonic() - t0,
            )
        await asyncio.sleep(PAUSE_POLL_S)
    pauses.running()
    return time.monotonic() - t0


class AReaLEngineView:
    """``EngineView`` over the engine AReaL 1.0.4 passes ``arun_episode``: its ``RemoteInfEngine``
    (the workflow executor's ``inference_engine``). Read through its public members, declared in
    ``cua_rl.areal.support``: a missing one fails the call, never reads as "not paused"."""

    def __init__(self, engine: Any, pauses: WeightPauses):
        self.engine = engine
        # Shared by every episode on this engine: the rollout runtime bound to it owns it.
        self.pauses = pauses

    def get_version(self) -> int:
        return int(self.engine.get_version())

    def is_paused(self) -> bool:
        return bool(self.engine.workflow_executor.is_paused())

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
    outage_s: float = 0.0  # time spent re-sending to a server that refused, dropped or 5xx'd
    paused_s: float = 0.0  # time spent waiting for weight updates
    cut: int = 0  # a sampled vision token dropped from the end (see session.py)
    seconds: float = 0.0
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked


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


@dataclass
class _Attempts:
    """What the attempts of one call gathered so far (aborts and retries append to it)."""

    outages: Outages  # the gateway's record of the calls held per server
    gen: Generation | None = None
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    aborts: int = 0
    failures: int = 0
    idle_aborts: int = 0
    paused_s: float = 0.0
    outage_s: float = 0.0  # outages this call lived through, ended
    down_since: float | None = None  # the current outage's start (monotonic)
    down_tries: int = 0  # re-sends in the current outage (its backoff grows with them)

    def restart(self) -> None:
        """A text request cannot carry the tokens sampled so far: the call starts over."""
        self.gen, self.out, self.lps, self.versions, self.top = None, [], [], [], []


def _outage_failed(server: str, reason: str, outage_s: float, st: _Attempts) -> float:
    """A failed send during an outage: the seconds to wait before the next, or ModelOutage."""
    now = time.monotonic()
    if st.down_since is None:
        st.down_since, st.down_tries = now, 0
        st.outages.hold(server, reason, outage_s)
    else:
        st.outages.failed_again(server, reason)
    st.failures += 1
    st.down_tries += 1
    down = now - st.down_since
    if down >= outage_s:
        raise ModelOutage(
            f"model server {server} unavailable for {down:.1f} s ({st.down_tries} re-sends), "
            f"past gateway.model_outage_s={outage_s:g}; last error: {reason}. Raise "
            "gateway.model_outage_s if the server restarts take longer",
            st.outage_s + down,
            st.failures,
        )
    return min(0.5 * 2 ** (st.down_tries - 1), OUTAGE_BACKOFF_CAP_S, outage_s - down)


def _outage_over(server: str, st: _Attempts) -> None:
    """The server answered: the call's outage (if it lived through one) and the server's end."""
    if st.down_since is not None:
        st.outages.release(server, answered=True)
        st.outage_s += time.monotonic() - st.down_since
        st.down_since = None


async def _post(client, server: str, path: str, body: dict, timeout_s: float, outage_s, st):
    """One attempt; None when the server is out (refused, dropped, 5xx): re-send after a wait."""
    try:
        resp = await client.post(f"{server_url(server)}{path}", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if resp.status_code < 500:
            _outage_over(server, st)
            return resp
        reason = f"answered {resp.status_code}: {resp.text[:300]}"
    await asyncio.sleep(_outage_failed(server, reason, outage_s, st))
    return None


def _answer_of(resp: httpx.Response, server: str, backend) -> Any:
    # A missing route, not a missing model (vLLM answers an unknown model 404 too, with an
    # error that names it): only then is text in the way to go on.
    missing_route = resp.status_code == 405 or (
        resp.status_code == 404 and "model" not in resp.text.lower()
    )
    if missing_route and backend.tokens_in:
        raise TokensInUnavailable(
            f"model server {server} has no {backend.path} ({resp.status_code})",
            status=resp.status_code,
        )
    if resp.status_code != 200:
        raise BadRequest(
            f"model server refused the prompt: {resp.text[:500]}", code="model_refused"
        )
    try:
        return resp.json()
    except ValueError as exc:
        raise ModelServerError(f"model server {server} answered non-JSON") from exc


def _absorb(st: _Attempts, parsed, ids: list[int], engine: EngineView, server: str, limit: int):
    if st.gen is None:
        # No prompt in the answer: the ids sent, pads included, are the prompt.
        st.gen = Generation(prompt_ids=parsed.prompt_ids or list(ids))
    st.out += parsed.output_ids
    st.lps += parsed.logprobs
    st.top += parsed.top or [[] for _ in parsed.output_ids]
    st.versions += spans_to_versions(parsed.spans, len(parsed.output_ids), engine.get_version())
    if parsed.finish_reason != "abort":
        return
    st.aborts += 1
    # An abort with no token and no pause is not a weight update: a server aborting everything
    # (overloaded, shutting down) must not be asked forever.
    idle = not parsed.output_ids and not engine.is_paused()
    st.idle_aborts = st.idle_aborts + 1 if idle else 0
    if st.idle_aborts >= limit:
        raise WaitFailed(
            f"model server {server} aborted the call {st.idle_aborts} times in a row with "
            "no token sampled and no weight update in progress",
            "abort_loop",
            st.paused_s,
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
    outage_s: float = 600.0,
    backend: Any = None,
    messages: list[dict] | None = None,
    max_aborts: int = 16,
    pause_bound: PauseBound | None = None,
    text_extra: dict | None = None,
    outages: Outages | None = None,
) -> Generation:
    """Sample up to ``max_tokens`` after ``ids``; an abort re-submits the prompt plus what was
    sampled so far, after any weight update in progress; a server that is out is re-sent the
    same request until it answers or ``outage_s`` passes. ``backend``
    (``cua_rl.gateway.backends``, vLLM tokens-in by default) shapes the request; a text backend
    sends ``messages`` (and ``text_extra``, e.g. the tools the server must render) and samples an
    aborted call again from its start. ``outages``: the gateway's record of held calls (a call
    with none is counted in a record of its own)."""
    backend = backend or VLLMTokens()
    pause_bound = pause_bound or GatewayConfig().pause_bound
    t0 = time.monotonic()
    st = _Attempts(outages if outages is not None else Outages())
    try:
        finish = "abort"
        while finish == "abort" and len(st.out) < max_tokens:
            try:
                st.paused_s += await wait_while_paused(engine, pause_bound)
            except WaitFailed as exc:
                exc.waited_s += st.paused_s
                raise
            if not backend.tokens_in and st.out:
                st.restart()
            body = backend.body(
                Request(ids + st.out, images, messages, sampling, max_tokens - len(st.out), model)
            )
            if text_extra and not backend.tokens_in:
                body.update(text_extra)
            resp = await _post(client, server, backend.path, body, timeout_s, outage_s, st)
            if resp is None:
                continue
            parsed = backend.parse(_answer_of(resp, server, backend))
            finish = parsed.finish_reason
            _absorb(st, parsed, ids, engine, server, max_aborts)
    finally:
        if st.down_since is not None:  # failed past the deadline, or cancelled, while held
            st.outages.release(server, answered=False)
    gen = st.gen
    gen.output_ids, gen.logprobs, gen.versions, gen.top = st.out, st.lps, st.versions, st.top
    # An abort that left no room is a call that ran out of tokens.
    gen.finish_reason = "length" if finish == "abort" else finish
    gen.aborts, gen.retries, gen.paused_s = st.aborts, st.failures, st.paused_s
    gen.outage_s = st.outage_s
    gen.seconds = time.monotonic() - t0
    return gen
