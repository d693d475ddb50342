"""Agent functions the tests train or break (``agent.mode: function``), each named by its path.

``loop_agent`` (async) and ``loop_agent_sync`` (a plain function, run in a thread) build their
requests as the local agent's loop does (the sim flavour, the full conversation) and send them
with the official ``openai`` SDK, so for the same model answers they act as the builtin and
service modes do. The others each go wrong one way: ``raising_agent``
raises after a model call, ``hanging_agent`` awaits an event nobody sets, ``hanging_sync_agent``
blocks its thread until the test releases it and then touches the box, ``silent_agent`` acts on
the box but never calls the model.
"""

from __future__ import annotations

import asyncio
import threading

from openai import AsyncOpenAI, OpenAI

from cua_rl.agent.actions import ActionParseError, read_reply, to_gym_action
from cua_rl.agent.context import ContextPolicy, Screen, StepRecord, build_messages
from cua_rl.agent.flavours import get_flavour


class _LocalLoop:
    """The local agent loop's requests and readings (sim flavour, ``full`` context, lenient),
    step by step, for an async and a sync agent alike."""

    def __init__(self, episode):
        self.episode = episode
        self.flavour, self.policy = get_flavour("sim"), ContextPolicy("full")
        self.history: list[StepRecord] = []
        self.screen: Screen | None = None

    def messages(self, step: int, shot) -> list[dict]:
        self.screen = Screen(step, shot.data_url, shot.width, shot.height)
        return build_messages(
            self.episode.task.instruction,
            self.history,
            self.screen,
            self.flavour,
            self.policy,
            device=self.episode.action_space,
        )

    def read(self, reply) -> tuple[dict | None, str | None]:
        """(the gym action to run, the final answer): an unreadable reply is the loop's
        ``invalid`` action, which the gym refuses."""
        text = reply.choices[0].message.content or ""
        screen = self.screen
        try:
            action = read_reply(text, screen.width, screen.height, lenient=True)
        except ActionParseError as exc:
            self.history.append(StepRecord(screen, text, None))
            return {"name": "invalid", "args": {"text": text, "error": str(exc)}}, None
        self.history.append(StepRecord(screen, text, action))
        if action.name == "finished":
            return None, action.params["text"]
        return to_gym_action(action), None


async def loop_agent(episode) -> str | None:
    """The local agent's loop as an async function, with the official SDK's async client."""
    loop, model = _LocalLoop(episode), episode.model
    async with AsyncOpenAI(base_url=model.base_url, api_key="any string works") as client:
        for step in range(1, episode.max_steps + 1):
            messages = loop.messages(step, await episode.box.screenshot())
            reply = await client.chat.completions.create(model=model.name, messages=messages)
            action, answer = loop.read(reply)
            if action is None:
                return answer
            await episode.box.act(action)
    return None


def loop_agent_sync(episode) -> str | None:
    """The same loop as a plain function (run in a thread), with the SDK's sync client."""
    loop, model = _LocalLoop(episode), episode.model
    with OpenAI(base_url=model.base_url, api_key="another string") as client:
        for step in range(1, episode.max_steps + 1):
            messages = loop.messages(step, episode.box.screenshot())
            reply = client.chat.completions.create(model=model.name, messages=messages)
            action, answer = loop.read(reply)
            if action is None:
                return answer
            episode.box.act(action)
    return None


class AgentBroke(RuntimeError):
    pass


async def raising_agent(episode) -> str:
    async with AsyncOpenAI(base_url=episode.model.base_url, api_key="k") as client:
        await client.chat.completions.create(
            model=episode.model.name, messages=[{"role": "user", "content": "Look."}]
        )
    raise AgentBroke("the agent broke after its first call")


async def hanging_agent(episode) -> str:
    await episode.box.screenshot()
    await asyncio.Event().wait()  # never set: only the deadline ends this
    return "unreachable"


# Set by the test once the episode is over; what the released thread met is in SEEN, and ENDED
# is set when the thread is done.
RELEASE, ENDED = threading.Event(), threading.Event()
SEEN: list[BaseException] = []


def hanging_sync_agent(episode) -> str:
    # Nothing before the wait: a box call there could outlast the deadline on a loaded machine
    # and end the thread early, which is not what the test is about.
    try:
        RELEASE.wait()
        episode.box.screenshot()
    except BaseException as exc:
        SEEN.append(exc)
        raise
    finally:
        ENDED.set()
    return "unreachable"


async def silent_agent(episode) -> str:
    shot = await episode.box.screenshot()
    await episode.box.act({"name": "tap", "args": {"x": shot.width // 2, "y": shot.height // 2}})
    return "done"
