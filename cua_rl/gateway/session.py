"""One episode's side of the gateway: a chat completion in, one captured turn out.

Per call: refuse what cannot be served (malformed messages, image hosts not allowed, before any
fetch), record the sampling settings the agent asked for and apply the trainer's instead, resolve
every image to bytes once per episode (the model and the row get the same bytes; presigned URLs
are never fetched twice), build the prompt ids from the stored conversation (``render``), sample
through the engine (``engine``), and answer in the OpenAI chat-completion shape. Calls of one
episode are served one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import httpx

from cua_rl.core.images import (
    check_image_url,
    decode_data_url,
    fetch_one,
    image_token_ids,
)
from cua_rl.errors import CuaRlError, ModelServerError, RejectedEpisode
from cua_rl.gateway.answer import chat_completion
from cua_rl.gateway.backends import VLLMText, backend_named
from cua_rl.gateway.capture import CapturedTurn, EpisodeCapture, GatewayError
from cua_rl.gateway.config import GatewayConfig, Sampling
from cua_rl.gateway.engine import (
    EngineView,
    ModelOutage,
    TokensInUnavailable,
    WaitFailed,
    generate,
)
from cua_rl.gateway.model_outages import Outages
from cua_rl.gateway.render import (
    BadRequest,
    Conversation,
    Image,
    expand_pads,
    extends_stored,
    image_identity,
    image_sources,
    message_key,
    normalize,
)
from cua_rl.gateway.requests import (
    GatewayFailure,
    check_tools,
    cut_at_stop,
    sampling_differences,
    stop_strings,
    top_logprobs,
    trainer_values,
)
from cua_rl.gateway.tools import PARSERS, template_format
from cua_rl.gateway.vision import ImageSizeError, PadCounter
from cua_rl.logs import get_logger
from cua_rl.trajectory.config import TrajectoryConfig

log = get_logger(__name__)

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def vision_token_ids(tokenizer) -> frozenset[int]:
    ids = set()
    for token in VISION_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return frozenset(ids)


class ClientGone(CuaRlError):
    """The client disconnected before its answer: nothing was committed."""


def _retrieve(task: asyncio.Task) -> None:
    # A generation nobody waits for any more may still fail; its error is not news.
    if not task.cancelled():
        task.exception()


@dataclass
class Clients:
    """Separate pools: image fetches never queue behind (or time out on) generations."""

    model: httpx.AsyncClient
    images: httpx.AsyncClient


@dataclass
class Sampled:
    """One generation, not yet committed (its client may never receive it)."""

    template: list[dict]
    key: tuple
    images: list[Image]
    segment: int
    prompt: Any
    gen: Any
    asked: dict
    overridden: dict
    tools: list | None = None
    parse_calls: bool = False  # tool_choice "auto" with tools: the reply is parsed for calls


@dataclass
class SessionSpec:
    """What the workflow knows when it opens an episode."""

    engine: EngineView
    sampling: Sampling
    processor: Any
    model_name: str
    images: TrajectoryConfig  # which image hosts may be fetched, size and time limits


class EpisodeSession:
    """One open episode; ``outages`` and ``explained`` are its gateway's (the calls held per model
    server, the pad-count fallbacks already logged), shared by the gateway's sessions."""

    def __init__(
        self,
        episode_id: str,
        spec: SessionSpec,
        config: GatewayConfig,
        outages: Outages | None = None,
        explained: set[str] | None = None,
    ):
        self.episode_id = episode_id
        self.spec = spec
        self.config = config
        self.outages = outages if outages is not None else Outages()
        self.capture = EpisodeCapture(episode_id)
        self.conversation = Conversation.for_processor(spec.processor, spec.sampling.stop_token_ids)
        self.tokenizer = getattr(spec.processor, "tokenizer", spec.processor)
        # A sampled vision token ends the reply and is dropped: in a row it would be taken for
        # an image position with no image (the row builder rejects it). Real models do not
        # sample them; tiny random ones do.
        self.vision_ids = vision_token_ids(self.tokenizer)
        self.sampling = replace(
            spec.sampling,
            stop_token_ids=sorted({*spec.sampling.stop_token_ids, *self.vision_ids}),
        )
        self.backend = backend_named(config.resolved_backend())
        self.closed = False
        self._images: dict[str, Image] = {}  # by image_identity of the agent's URL
        self._by_hash: dict[str, Image] = {}
        self._pads: dict[str, int] = {}  # image hash -> its pad count (backends that need it)
        self._counter = PadCounter(spec.processor, spec.images, explained)
        self._server: str | None = None
        self._lock: asyncio.Lock | None = None
        self.inflight: set[asyncio.Task] = set()
        self._pending: tuple[str, asyncio.Task] | None = None  # a call whose client left
        self._last: tuple[str, dict] | None = None  # the last delivered call: key, answer
        self._tool_format: str | None | bool = False  # False: not probed yet

    @property
    def tool_format(self) -> str | None:
        """The tool-call format the model's chat template writes (None: it renders no tools)."""
        if self._tool_format is False:
            render = self.conversation.render
            self._tool_format = template_format(lambda m, tools: render(m, True, tools))
        return self._tool_format

    async def chat(
        self,
        body: Any,
        clients: Clients,
        *,
        key: str = "",
        retry: int = 0,
        gone: Callable[[], Awaitable[Any]] | None = None,
    ) -> dict:
        """Answer one call. ``key`` identifies the request's bytes, ``retry`` is the official
        SDKs' ``x-stainless-retry-count`` (0 on a first attempt). An identical request whose
        generation no client received yet (its client left) joins that generation; one that
        repeats the last delivered call is a new call (an agent re-asking what did not parse)
        unless it is an SDK retry, which gets the stored answer (the answer was lost on its way).
        ``gone`` completes when the client disconnects: the call then commits nothing and its
        generation is kept for a re-send."""
        self.capture.received += 1
        if self.closed:
            raise GatewayFailure(
                f"episode {self.episode_id} is closed", status=404, code="episode_closed"
            )
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            call = self._pending
            repeats_last = bool(key) and self._last is not None and self._last[0] == key
            if key and call is not None and call[0] == key:
                self.capture.resends += 1
            elif repeats_last and retry > 0:
                self.capture.resends += 1
                return self._last[1]
            else:
                self.capture.reasks += int(repeats_last)
                self._drop_pending()
                # From here on, a retry of this request is answered by its own generation (or
                # errors): never by an older answer to the same bytes.
                self._last = None
                call = self._pending = (key, asyncio.create_task(self._sample(body, clients)))
                call[1].add_done_callback(_retrieve)
            await self._until_done(call[1], gone)
            self._pending = None
            if call[1].cancelled():
                raise GatewayFailure(
                    f"episode {self.episode_id} ended during the call",
                    status=404,
                    code="episode_closed",
                )
            try:
                sampled = call[1].result()
            except GatewayFailure as exc:
                self.capture.errors.append(GatewayError(exc.code, str(exc), exc.status))
                raise
            answer = self._commit(sampled, body)
            self._last = (key, answer)
            return answer

    async def _until_done(
        self, task: asyncio.Task, gone: Callable[[], Awaitable[Any]] | None
    ) -> None:
        """Wait for the generation, or for the client to leave (``ClientGone``; the generation
        goes on for a re-send). A cancelled handler (a stream the client closed) counts too."""
        waiter = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            done, _ = await asyncio.wait(
                {task} | ({waiter} if waiter else set()), return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            if not self.closed:
                self.capture.disconnects += 1
            raise
        finally:
            if waiter is not None:
                waiter.cancel()
        if task not in done:
            self.capture.disconnects += 1
            raise ClientGone(f"the client of episode {self.episode_id} disconnected")

    def _drop_pending(self) -> None:
        """A different call came (or the episode ended): the generation nobody received is
        discarded, never committed."""
        if self._pending is not None:
            self.capture.discarded += 1
            self._pending[1].cancel()
            self._pending = None

    def _check(self, body: Any) -> tuple[dict, dict, list | None, bool, Sampling]:
        """What the request asks, refused before anything is fetched: (asked, overridden,
        tools, whether to parse calls, this call's sampling)."""
        if not isinstance(body, dict):
            raise GatewayFailure("the body must be a JSON object", status=400, code="invalid_json")
        if body.get("n") not in (None, 1):
            raise GatewayFailure(
                "n must be 1: one sample per call", status=400, code="unsupported_n"
            )
        tools, parse = check_tools(body, lambda: self.tool_format)
        asked, overridden = sampling_differences(body, self.spec.sampling)
        if overridden and self.config.sampling_mismatch == "error":
            raise GatewayFailure(
                f"sampling settings are the trainer's; the request asks {overridden} but the "
                f"trainer samples with {trainer_values(self.spec.sampling)}",
                status=400,
                code="sampling_mismatch",
            )
        sampling = replace(self.sampling, top_logprobs=top_logprobs(body), stop=stop_strings(body))
        return asked, overridden, tools, parse, sampling

    async def _sample(self, body: Any, clients: Clients) -> Sampled:
        asked, overridden, tools, parse, sampling = self._check(body)
        try:
            known = await self._resolve_images(body.get("messages"), clients.images)
            template, images, key = normalize(body.get("messages"), known, tools)
        except BadRequest as exc:
            raise GatewayFailure(str(exc), status=400, code=exc.code) from exc
        except RejectedEpisode as exc:
            raise GatewayFailure(
                f"{exc.reason}: {exc.detail}", status=400, code=exc.reason
            ) from exc
        if len(images) > self.config.max_images:
            raise GatewayFailure(
                f"{len(images)} images > gateway.max_images {self.config.max_images}",
                status=400,
                code="too_many_images",
            )
        prompt = self.conversation.prompt(template, images, key, tools)
        self._pick_server()
        try:
            try:
                gen = await self._generate(clients.model, prompt, template, sampling, tools)
            except TokensInUnavailable as exc:
                log.warning("%s; episode %s goes on with text in", exc, self.episode_id)
                self.backend = VLLMText()
                gen = await self._generate(clients.model, prompt, template, sampling, tools)
        except BadRequest as exc:
            raise GatewayFailure(str(exc), status=400, code=exc.code) from exc
        except WaitFailed as exc:
            status = 502 if exc.code == "abort_loop" else 503
            raise GatewayFailure(str(exc), status=status, code=exc.code, kind="api_error") from exc
        except ModelOutage as exc:
            self.capture.outage_s += exc.outage_s
            self.capture.outage_retries += exc.retries
            raise GatewayFailure(
                str(exc), status=502, code="model_server_error", kind="api_error"
            ) from exc
        except ModelServerError as exc:
            raise GatewayFailure(
                str(exc), status=502, code="model_server_error", kind="api_error"
            ) from exc
        # Counted when sampled, received or not: the episode waited out the outage either way.
        self.capture.outage_s += gen.outage_s
        self.capture.outage_retries += gen.retries
        self._trim(gen, sampling.stop)
        return Sampled(
            template, key, images, prompt.segment, prompt, gen, asked, overridden, tools, parse
        )

    def _pick_server(self) -> None:
        if self._server is not None:
            return
        # One server per episode: its KV and image caches then serve every later turn.
        try:
            self._server = self.config.model_server_url or self.spec.engine.choose_server()
        except (IndexError, RuntimeError, AttributeError) as exc:
            # The engine is being torn down (the training ended under a late episode).
            raise GatewayFailure(
                f"no inference server to sample from: {type(exc).__name__}: {exc}",
                status=503,
                code="engine_unavailable",
                kind="api_error",
            ) from exc

    def _trim(self, gen, stops: list[str]) -> None:
        """A sampled vision token ends the reply and is dropped; a stop string ends it before
        the token that holds it (the agent and the row get the same tokens)."""
        keep = None
        if gen.output_ids and gen.output_ids[-1] in self.vision_ids:
            keep, gen.cut = len(gen.output_ids) - 1, 1
        if stops:
            ids = gen.output_ids[:keep]
            decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
            at = cut_at_stop(ids, decode, stops)
            keep = at if at is not None else keep
        if keep is None:
            return
        gen.output_ids, gen.logprobs = gen.output_ids[:keep], gen.logprobs[:keep]
        gen.versions, gen.top = gen.versions[:keep], gen.top[:keep]
        gen.finish_reason = "stop"

    def _commit(self, s: Sampled, body: dict) -> dict:
        """The call was received: its turn joins the conversation and the capture."""
        gen = s.gen
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if s.parse_calls and (parsed := PARSERS[self.tool_format](text)).calls:
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [call.openai() for call in parsed.calls],
            }
        self.conversation.commit(
            s.template,
            s.key,
            gen.prompt_ids,
            gen.output_ids,
            text,
            s.segment,
            reply_key=message_key(message),
            tools=s.tools,
        )
        new_tools = s.tools and all(t.tools != s.tools for t in self.capture.turns)
        # A captured turn keeps every field of the generation under the same name.
        turn = CapturedTurn(
            index=len(self.capture.turns),
            response_id=f"chatcmpl-{uuid.uuid4().hex}",
            text=text,
            images=s.images,
            segment=s.segment,
            extended=extends_stored(s.prompt, gen.prompt_ids),
            backend=self.backend.name,
            asked=s.asked,
            overridden=s.overridden,
            server=self._server,
            message=message,
            tools=s.tools,
            tools_first_seen=bool(new_tools),
            **{f.name: getattr(gen, f.name) for f in fields(gen)},
        )
        self.capture.turns.append(turn)
        return self.answer(turn, body)

    async def _generate(self, client, prompt, template, sampling: Sampling, tools):
        send_ids, images = prompt.send_ids, prompt.images
        ids = send_ids
        pad_id, _ = image_token_ids(self.spec.processor)
        counts: list[int] = []
        if images and (not self.backend.expands_pads or self.sampling.max_tokens > 0):
            # Off the event loop: a processor without a known rule runs the whole processor.
            counts = await asyncio.to_thread(self._pad_counts, images)
        if not self.backend.expands_pads:
            ids = expand_pads(send_ids, pad_id, counts)
        # The prompt as the model sees it (every image's pads) counts against max_tokens.
        room = sampling.room(len(send_ids) - len(images) + sum(counts))
        if room <= 0:
            raise GatewayFailure(
                f"the prompt fills gconfig.max_tokens={sampling.max_tokens}: no room to "
                "sample (shorten the history, or raise gconfig.max_tokens)",
                status=400,
                code="context_length_exceeded",
            )
        return await generate(
            client,
            self.spec.engine,
            self._server,
            ids,
            images,
            sampling,
            max_tokens=room,
            model=self.spec.model_name,
            timeout_s=self.config.request_timeout_s,
            outage_s=self.config.model_outage_s,
            backend=self.backend,
            messages=template,
            max_aborts=self.config.max_aborts,
            pause_bound=self.config.pause_bound,
            outages=self.outages,
            # Text in: the server renders the tools; it must not parse calls (the gateway
            # does), and vLLM parses only when started with a tool parser.
            text_extra={"tools": tools, "tool_choice": "none"} if tools else None,
        )

    def _pad_counts(self, images: list[Image]) -> list[int]:
        """Each image's pad count, as the processor (and so the row builder) expands it; new
        images are measured once per episode (by their size, see ``vision``)."""
        new = {img.sha256: img.data for img in images if img.sha256 not in self._pads}
        if new:
            try:
                counts = self._counter.counts(list(new.values()))
            except (ImageSizeError, RejectedEpisode) as exc:
                raise GatewayFailure(str(exc), status=400, code="invalid_image") from exc
            self._pads.update(zip(new, counts, strict=True))
        return [self._pads[img.sha256] for img in images]

    async def _resolve_images(self, messages: Any, client: httpx.AsyncClient) -> dict:
        """This call's images by the URL the agent wrote: each distinct image is fetched once
        per episode (by ``image_identity``: re-signed URLs included) and held once (by hash)."""
        if not isinstance(messages, list):
            return {}
        urls = list(dict.fromkeys(image_sources(messages)))
        ids = {src: image_identity(src) for src in urls}
        new = [src for src in urls if ids[src] not in self._images]
        policy = self.spec.images
        # Every URL is checked before the first fetch: a refused host costs no request.
        kinds = {src: check_image_url(src, policy) for src in new}
        for src in new:
            if ids[src] in self._images:  # the same image twice in one call
                continue
            if kinds[src] == "data":
                data = decode_data_url(src, policy.max_image_bytes)
            else:
                data = await fetch_one(client, src, policy)
                self.capture.fetches += 1
            image = Image.of(data, src)
            self._images[ids[src]] = self._by_hash.setdefault(image.sha256, image)
        return {src: self._images[ids[src]] for src in urls}

    def answer(self, turn: CapturedTurn, body: dict) -> dict:
        return chat_completion(turn, body, self.tokenizer, self.spec.model_name)

    def close(self) -> EpisodeCapture:
        self.closed = True
        if self._pending is not None:
            task = self._pending[1]
            self.capture.discarded += 1
            self._pending = None
            task.get_loop().call_soon_threadsafe(task.cancel)
        for task in list(self.inflight):
            loop = task.get_loop()
            loop.call_soon_threadsafe(task.cancel)
        self.capture.counters = self.capture.stats()  # closed: no call adds to them any more
        return self.capture
