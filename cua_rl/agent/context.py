"""Context policies: which messages an agent sends the model at each step (docs/agent.md).

Real GUI agents do not all keep an append-only conversation. Each policy here is a pure
function of the episode so far (``StepRecord``: the screen a step saw, the reply it got, the
action parsed from it), the current screen, the flavour and the policy, so the local agent's
server and any other agent loop build identical requests, and tests check them without a server:

- ``full``: system prompt, task, then per earlier step its screenshot and the reply verbatim,
  then the current screenshot. Every prompt extends the previous prompt + output.
- ``mai-ui``: built afresh each step as MAI-UI's navigation agent does. Earlier steps whose
  reply did not parse are left out; each kept step is its assistant text re-rendered from the
  parsed action in the flavour's canonical form (never the sampled text), preceded by its
  screenshot only for the last ``history_n - 1`` kept steps; then the current screenshot. A
  reply that does not parse is asked again with the same request (``max_asks`` calls in all).
- ``current``: only the current screenshot, with the earlier parsed actions as a numbered list of
  their canonical one-line calls (Qwen3-VL's computer-use cookbook).
"""

from __future__ import annotations

from dataclasses import dataclass

from cua_rl.agent.actions import Action
from cua_rl.agent.flavours import Flavour

POLICIES = ("full", "mai-ui", "current")
DEFAULT_HISTORY_N = 3
# MAI-UI's agent tries a step's call at most this many times before giving up on the step.
MAI_UI_ASKS = 3


@dataclass(frozen=True)
class ContextPolicy:
    name: str = "full"
    history_n: int = DEFAULT_HISTORY_N  # mai-ui: screenshots per request, the current one included

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"context must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if (
            not isinstance(self.history_n, int)
            or isinstance(self.history_n, bool)
            or self.history_n < 1
        ):
            raise ValueError(f"historyN must be an integer >= 1, got {self.history_n!r}")

    @property
    def max_asks(self) -> int:
        """Model calls per step while the reply does not parse."""
        return MAI_UI_ASKS if self.name == "mai-ui" else 1


@dataclass(frozen=True)
class Screen:
    step: int  # 1-based step that observed it
    image_url: str  # what the model is sent (data URL or the gym's URL)
    width: int
    height: int


@dataclass(frozen=True)
class StepRecord:
    screen: Screen
    reply: str  # the sampled text of the step's last model call
    action: Action | None  # None: no call of the step parsed


def screen_message(screen: Screen, note: str = "") -> dict:
    caption = f"Step {screen.step}. Screen {screen.width}x{screen.height}."
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": caption + note},
            {"type": "image_url", "image_url": {"url": screen.image_url}},
        ],
    }


def build_messages(
    task: str,
    history: list[StepRecord],
    current: Screen,
    flavour: Flavour,
    policy: ContextPolicy,
    *,
    device: str = "mobile",
    tools: list[dict] | None = None,
) -> list[dict]:
    """The chat messages of the request for ``current``, after the steps in ``history``."""
    messages: list[dict] = [
        {"role": "system", "content": flavour.prompt(tools, device)},
        {"role": "user", "content": f"Task: {task}"},
    ]
    if policy.name == "full":
        for h in history:
            messages.append(screen_message(h.screen))
            messages.append({"role": "assistant", "content": h.reply})
        messages.append(screen_message(current))
        return messages
    kept = [h for h in history if h.action is not None]
    if policy.name == "mai-ui":
        first_image = len(kept) - (policy.history_n - 1)
        for i, h in enumerate(kept):
            if i >= first_image:
                messages.append(screen_message(h.screen))
            text = flavour.render(h.action, h.screen.width, h.screen.height, device)
            messages.append({"role": "assistant", "content": text})
        messages.append(screen_message(current))
        return messages
    lines = [
        f"{n}. {flavour.describe(h.action, h.screen.width, h.screen.height, device)}"
        for n, h in enumerate(kept, 1)
    ]
    note = "\nPrevious actions:\n" + "\n".join(lines) if lines else ""
    messages.append(screen_message(current, note))
    return messages


def count_images(messages: list[dict]) -> int:
    """Image parts in a request's messages."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") in ("image_url", "image")
    )
