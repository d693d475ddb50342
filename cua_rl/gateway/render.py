"""An episode's conversation as token ids: tokens in, tokens out, so the prefix holds by construction.

The agent resends its whole message history every turn. Re-rendering that history through the
chat template and tokenizing it again would change the model's own earlier outputs (BPE merges,
partial UTF-8, dropped special tokens), so the gateway keeps the exact ids of the
conversation so far (the last prompt as the server expanded it, plus the sampled ids) and, when a
request extends the previous one (the same messages plus the reply it was given), renders and
tokenizes only what is new: the template's closing of the assistant turn and the new messages.
A request that does not extend the previous one (the agent dropped or edited history) starts a
new segment rendered from scratch; the row builder then applies its prefix-break policy.

Images are compared by content hash, not URL (presigned URLs change). Prompts are sent with one
``<|image_pad|>`` per image: the server expands them itself and returns the expanded ids, which
become the stored ids. Pure: no I/O; images arrive already fetched.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cua_rl.core import images as core_images
from cua_rl.gateway.tools import arguments_object, canonical_arguments


class BadRequest(ValueError):
    """The agent's request cannot be served as sent; the message goes back to the agent (400)."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Image:
    """One image as the model received it: its bytes, their hash and where the agent had it."""

    sha256: str
    data: bytes
    mime: str
    source: str  # the agent's URL (data: URLs are shortened to their header and size)

    @classmethod
    def of(cls, data: bytes, source: str) -> Image:
        digest = hashlib.sha256(data).hexdigest()
        if source.startswith("data:"):
            source = f"{source.split(',', 1)[0]},<{len(data)} bytes>"
        return cls(digest, data, sniff_mime(data), source)

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode()}"


def sniff_mime(data: bytes) -> str:
    mime = core_images.sniff_mime(data, gif=True)
    if mime is None:
        raise BadRequest("an image part is not PNG, JPEG, WebP or GIF", code="invalid_image")
    return mime


def image_source(part: Mapping[str, Any]) -> str | None:
    """The URL of an image content part in any of the shapes agents send, else None."""
    kind = part.get("type")
    if kind == "image_url":
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, Mapping) else inner
        return url if isinstance(url, str) else None
    if kind == "image" or (kind is None and ("image" in part or "url" in part)):
        url = part.get("url") or part.get("image")
        return url if isinstance(url, str) else None
    return None


# Query parameters that sign or date a URL (S3, GCS, CloudFront, Azure SAS) rather than name its
# object: a screenshot re-signed each turn is still the same screenshot.
_SIGNING = frozenset(
    "signature expires key-pair-id policy awsaccesskeyid sig se st sp sv sr spr srt ss skoid "
    "sktid skt ske sks skv".split()
)


def image_identity(source: str) -> str:
    """What names an image across turns: a data URL by its hash (the string is not kept), an
    http(s) URL without the parameters that only sign it."""
    if source.startswith("data:"):
        return "data:" + hashlib.sha256(source.encode()).hexdigest()
    base, sep, query = source.partition("?")
    if not sep:
        return source
    kept = [
        p
        for p in query.split("&")
        if (name := p.split("=", 1)[0].lower()) not in _SIGNING
        and not name.startswith(("x-amz-", "x-goog-"))
    ]
    return base + ("?" + "&".join(kept) if kept else "")


def image_sources(messages: Sequence[Any]) -> list[str]:
    """Every image URL of a request, in prompt order (what must be fetched or decoded)."""
    out: list[str] = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            out.extend(s for p in content if isinstance(p, Mapping) and (s := image_source(p)))
    return out


def normalize(
    messages: Any, images: Mapping[str, Image], tools: list | None = None
) -> tuple[list[dict], list[Image], tuple]:
    """Agent messages -> (template messages, images in order, comparison key).

    Template messages keep only what a chat template reads (role, text, an image placeholder,
    an assistant's tool calls); the key identifies a message list by the tools, role, text,
    image hashes and calls (arguments compared as objects, call ids ignored).
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out: list[dict] = []
    order: list[Image] = []
    key: list[tuple] = []
    if tools:
        key.append(("\x00tools", json.dumps(tools, sort_keys=True)))
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'")
        content, pkey = _content(msg.get("content"), images, order, i)
        template: dict[str, Any] = {"role": msg["role"], "content": content}
        if msg["role"] == "tool" and isinstance(msg.get("tool_call_id"), str):
            template["tool_call_id"] = msg["tool_call_id"]  # not rendered, not compared
        calls = msg.get("tool_calls")
        if calls and msg["role"] == "assistant":
            template["tool_calls"], ckey = _calls(calls, i)
            pkey = (*pkey, *ckey)
        out.append(template)
        key.append((msg["role"], *pkey))
    return out, order, tuple(key)


def message_key(message: Mapping[str, Any]) -> tuple:
    """The comparison key of one text message (an answer as the agent will send it back)."""
    return normalize([message], {})[2][-1]


def _content(content: Any, images: Mapping[str, Image], order: list[Image], i: int):
    """One message's content for the template, and its key parts."""
    if content is None or isinstance(content, str):
        return content or "", (content or "",)
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
    parts: list[dict] = []
    pkey: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise BadRequest(f"messages[{i}].content[{j}] must be an object")
        src = image_source(part)
        if src is not None:
            img = images[src]
            order.append(img)
            parts.append({"type": "image"})
            pkey.append("\x00img:" + img.sha256)
        elif part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            pkey.append(part["text"])
        else:
            raise BadRequest(
                f"messages[{i}].content[{j}] has type {part.get('type')!r}; the gateway "
                "serves text and image parts"
            )
    return parts, tuple(pkey)


def _calls(calls: Any, i: int) -> tuple[list[dict], tuple]:
    """An assistant's OpenAI ``tool_calls`` as templates read them (arguments as objects)."""
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list")
    out: list[dict] = []
    key: list[str] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"messages[{i}].tool_calls[{j}] must hold a function with a name")
        args = fn.get("arguments", {})
        out.append(
            {
                # The id is not rendered (nor compared); text in passes it on as OpenAI needs.
                "id": str(call.get("id") or f"call_{i}_{j}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments_object(args)},
            }
        )
        key.append(f"\x00call:{fn['name']}:{canonical_arguments(args)}")
    return out, tuple(key)


def collapse_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """One pad per image: the server expands each run again from the image itself."""
    out: list[int] = []
    prev_pad = False
    for t in ids:
        if t == pad_id and prev_pad:
            continue
        prev_pad = t == pad_id
        out.append(t)
    return out


def expand_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """One pad per image -> each image's pad run (``counts`` in image order)."""
    runs = iter(counts)
    out: list[int] = []
    for t in ids:
        if t == pad_id:
            try:
                out.extend([pad_id] * next(runs))
            except StopIteration:
                raise BadRequest("more image pads in the prompt than images") from None
        else:
            out.append(t)
    if next(runs, None) is not None:
        raise BadRequest("more images than image pads in the prompt")
    return out


@dataclass
class Prompt:
    """What one request sends: ids with one pad per image, and every image of the prompt."""

    send_ids: list[int]
    images: list[Image]
    # The expanded ids the server's prompt must start with (the conversation so far), when the
    # request extends the previous turn; None for a new segment.
    expected_prefix: list[int] | None
    segment: int


@dataclass
class _Last:
    """The previous turn, as the next request must repeat it to extend it."""

    key: tuple
    template_messages: list[dict]
    ids: list[int]  # its prompt as the server expanded it + the sampled ids
    reply: str  # the sampled text
    ended_with: int | None  # the sampled stop token, if the reply ended on one
    reply_key: tuple = ()  # the answer's key, as the agent sends it back (content, tool calls)
    tools: list | None = None
    prompt_len: int = 0  # ids[:prompt_len] is its prompt as the server expanded it


@dataclass
class Conversation:
    """Token state of one episode; ``prompt`` then ``commit`` once per model call."""

    # (messages, add_generation_prompt, tools) -> text
    render: Callable[[list[dict], bool, list | None], str]
    encode: Callable[[str], list[int]]
    decode_token: Callable[[int], str]
    pad_id: int
    stop_ids: frozenset[int] = frozenset()
    segments: int = 0
    _last: _Last | None = field(default=None, repr=False)

    @classmethod
    def for_processor(cls, processor, stop_ids: Sequence[int] = ()) -> Conversation:
        from cua_rl.core.images import image_token_ids, tokenizer_of

        tok = tokenizer_of(processor)
        pad_id, _ = image_token_ids(processor)
        stops = set(stop_ids)
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != tok.unk_token_id:
            stops.add(im_end)

        def render(messages: list[dict], generation: bool, tools: list | None = None) -> str:
            return processor.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
            )

        return cls(
            render=render,
            encode=lambda text: list(tok.encode(text, add_special_tokens=False)),
            decode_token=lambda t: tok.decode([t], skip_special_tokens=False),
            pad_id=pad_id,
            stop_ids=frozenset(stops),
        )

    def prompt(
        self,
        template_messages: list[dict],
        images: list[Image],
        key: tuple,
        tools: list | None = None,
    ) -> Prompt:
        last = self._last
        if last is not None and key == last.key and tools == last.tools:
            # The previous request asked again (its reply did not parse): a branch, so a new
            # segment, but its prompt is the exact ids sent before, not a re-rendering.
            ids = last.ids[: last.prompt_len]
            return Prompt(collapse_pads(ids, self.pad_id), images, list(ids), self.segments + 1)
        delta = self._delta(template_messages, key, tools)
        if delta is None:
            # Counted at commit: a prompt whose answer nobody received starts no segment.
            text = self.render(template_messages, True, tools)
            return Prompt(self.encode(text), images, None, self.segments + 1)
        return Prompt(
            collapse_pads(last.ids, self.pad_id) + self.encode(delta),
            images,
            list(last.ids),
            self.segments,
        )

    def _delta(self, template_messages: list[dict], key: tuple, tools: list | None) -> str | None:
        """The text to append to the stored ids, or None when the request starts afresh."""
        last = self._last
        if last is None:
            return None
        before = (*last.key, last.reply_key or ("assistant", last.reply))
        if key[: len(before)] != before or len(key) == len(before):
            return None
        # The reply is the sampled text whatever the agent sent back (its content and tool
        # calls, which the template may write with other spacing): the stored ids are kept.
        sampled = {"role": "assistant", "content": last.reply}
        n = len(last.template_messages)
        replied = [*last.template_messages, sampled]
        closed = self.render(replied, False, tools)
        full = self.render([*replied, *template_messages[n + 1 :]], True, tools)
        opened = self.render(last.template_messages, True, tools)
        if not full.startswith(closed) or not closed.startswith(opened):
            return None
        turn = closed[len(opened) :]
        # What the template writes after the reply (e.g. "<|im_end|>\n"); when the template
        # rewrote the reply (some strip reasoning), its closing is found after the last special.
        close = turn[len(last.reply) :] if turn.startswith(last.reply) else self._closing(turn)
        if last.ended_with is not None:
            stop_text = self.decode_token(last.ended_with)
            if stop_text and close.startswith(stop_text):
                close = close[len(stop_text) :]
        return close + full[len(closed) :]

    def _closing(self, turn: str) -> str:
        probe = self.render(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x01"}],
            False,
            None,
        )
        tail = probe.split("\x01", 1)[-1]
        return turn[turn.rfind(tail) :] if tail and tail in turn else tail

    def commit(
        self,
        template_messages: list[dict],
        key: tuple,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        reply: str,
        segment: int,
        reply_key: tuple = (),
        tools: list | None = None,
    ) -> None:
        """The answered call (``segment``: its prompt's) becomes the turn to extend;
        ``reply_key``: the key of the answer as given (``message_key``)."""
        self.segments = max(self.segments, segment)
        ended = int(output_ids[-1]) if output_ids and output_ids[-1] in self.stop_ids else None
        ids = [*prompt_ids, *output_ids]
        self._last = _Last(
            key, list(template_messages), ids, reply, ended, reply_key, tools, len(prompt_ids)
        )


def extends_stored(prompt: Prompt, server_prompt_ids: Sequence[int]) -> bool:
    """Whether the server's prompt begins with the conversation so far (it should: the stored
    ids were the server's own expansion). When it does not, the server's ids are the truth and
    the row builder sees a prefix break."""
    if prompt.expected_prefix is None:
        return True
    n = len(prompt.expected_prefix)
    return list(server_prompt_ids[:n]) == prompt.expected_prefix
