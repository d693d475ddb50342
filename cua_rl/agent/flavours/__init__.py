"""Agent flavours: how the local agent prompts the model and reads an action from its reply.

- ``sim``: the local action language (``tap(X, Y)``, ...; ``cua_rl.agent.actions``), which the
  tiny random models' tests constrain decoding to.
- ``mai-ui``: MAI-UI's ``<thinking>`` + ``mobile_use`` tool call, with answering, asking the user
  and MCP tool calls (``cua_rl.agent.flavours.mai_ui``).
- ``qwen3-vl``: Qwen3-VL's ``mobile_use`` / ``computer_use`` function calls declared in a
  ``<tools>`` block (``cua_rl.agent.flavours.qwen3_vl``).

Every flavour turns a reply into the same ``Action`` the agent executes on the gym, so a real
checkpoint's replies run against the sim unchanged, and renders a parsed action back into its
canonical text (``render``: an assistant message; ``describe``: one line of a list of earlier
actions), which the context policies (``cua_rl.agent.context``) put in the history. The prompt
and the function names follow the device (``standardActionSpace``: ``mobile`` or ``pc``).
docs/agent.md documents each format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cua_rl.agent.actions import Action


class ReadReply(Protocol):
    def __call__(
        self, text: str, width: int, height: int, *, lenient: bool = False, grid: int = ...
    ) -> Action: ...


@dataclass(frozen=True)
class Flavour:
    name: str
    # (extra tools: MAI-UI's MCP tools, more Qwen functions; device) -> the system message
    prompt: Callable[[list[dict] | None, str], str]
    read_reply: ReadReply
    # (parsed action, width, height, device) -> canonical assistant text / one-line call
    render: Callable[[Action, int, int, str], str]
    describe: Callable[[Action, int, int, str], str]


FLAVOUR_NAMES = ("sim", "mai-ui", "qwen3-vl")
DEVICES = ("mobile", "pc")


def _sim_text(action: Action, width: int, height: int, device: str = "mobile") -> str:
    from cua_rl.agent.actions import format_action

    return format_action(action)


def get_flavour(name: str) -> Flavour:
    from cua_rl.agent import actions
    from cua_rl.agent.flavours import mai_ui, qwen3_vl

    if name == "sim":
        return Flavour(
            "sim",
            lambda tools, device="mobile": actions.system_prompt(device),
            actions.read_reply,
            _sim_text,
            _sim_text,
        )
    if name == mai_ui.NAME:
        return Flavour(
            name, mai_ui.system_prompt, mai_ui.read_reply, mai_ui.render, mai_ui.describe
        )
    if name == qwen3_vl.NAME:
        return Flavour(
            name, qwen3_vl.system_prompt, qwen3_vl.read_reply, qwen3_vl.render, qwen3_vl.describe
        )
    raise ValueError(f"unknown agent flavour {name!r}; use one of {', '.join(FLAVOUR_NAMES)}")
