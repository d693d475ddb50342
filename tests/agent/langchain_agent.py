"""An agent written with an agent framework, trained through the gateway unchanged: LangChain.

``run``: LangChain's OpenAI chat model (``langchain_openai.ChatOpenAI``) pointed at the episode's
model URL, a screenshot in and one action out per turn. ``example_or_langchain`` is the shared
training's agent (tests/app/test_function_train.py): the tasks with an even number go to this
agent, the others to the example's ``openai`` agent, each called as it is.
"""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from cua_rl.agent.actions import ActionParseError, read_reply, system_prompt, to_gym_action
from examples.cua_agent import openai_agent


async def run(episode) -> str | None:
    model = episode.model
    llm = ChatOpenAI(base_url=model.base_url, api_key=model.api_key, model=model.name)
    messages: list = [
        SystemMessage(system_prompt(episode.action_space)),
        HumanMessage(f"Task: {episode.task.instruction}"),
    ]
    for step in range(1, episode.max_steps + 1):
        shot = await episode.box.screenshot()
        messages.append(
            HumanMessage(
                [
                    {"type": "text", "text": f"Step {step}. Screen {shot.width}x{shot.height}."},
                    {"type": "image_url", "image_url": {"url": shot.data_url}},
                ]
            )
        )
        reply = await llm.ainvoke(messages)
        text = reply.content if isinstance(reply.content, str) else ""
        messages.append(AIMessage(text))
        try:
            action = read_reply(text, shot.width, shot.height, lenient=True)
        except ActionParseError:
            continue
        if action.name == "finished":
            return action.params["text"]
        await episode.box.act(to_gym_action(action))
    return None


def uses_langchain(task_data) -> bool:
    """Which agent a task gets in the shared training: LangChain for an even task number."""
    return int(task_data.get("number") or 0) % 2 == 0


async def example_or_langchain(episode) -> str | None:
    """The example agent or this one, by task; each called unchanged. The line it prints lands
    in the rollout worker's log, where the training's test reads who ran which task."""
    agent = run if uses_langchain(episode.task.data) else openai_agent.run
    print(f"[example_or_langchain] {agent.__module__} on {episode.task.id}", flush=True)
    return await agent(episode)
