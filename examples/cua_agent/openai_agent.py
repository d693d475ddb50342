"""An agent of your own, trained through the rollout gateway unchanged: the official ``openai`` SDK.

Each turn: take a screenshot, send it with the conversation so far to the model, read one action
from the reply, run it on the box. The episode's model URL is the rollout gateway's, so every call
is captured and trained; nothing here knows about training. Train it on this machine::

    make demo DEMO_ARGS="--agent-mode function"

(``agent.mode=function agent.function=examples.cua_agent.openai_agent:run``; docs/agent.md,
"Train your own agent"). Replies are read in the local gym's action language (``tap(X, Y)``,
``type("TEXT")``, ``finished("ANSWER")``, ...) by cua-rl's parser, leniently: a tiny random model
rarely writes a valid call, and a reply that is none taps the grid cell its first character
names. A parser of your own does as well: the box takes the gym's ``{name, args}``.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from cua_rl.agent.actions import ActionParseError, read_reply, system_prompt, to_gym_action


async def run(episode) -> str | None:
    """One episode (``cua_rl.agent.function.AgentEpisode``); the final answer, or None."""
    model = episode.model
    messages: list[dict] = [
        {"role": "system", "content": system_prompt(episode.action_space)},
        {"role": "user", "content": f"Task: {episode.task.instruction}"},
    ]
    async with AsyncOpenAI(base_url=model.base_url, api_key=model.api_key) as client:
        for step in range(1, episode.max_steps + 1):
            shot = await episode.box.screenshot()
            screen = f"Step {step}. Screen {shot.width}x{shot.height}."
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": screen},
                        {"type": "image_url", "image_url": {"url": shot.data_url}},
                    ],
                }
            )
            reply = await client.chat.completions.create(model=model.name, messages=messages)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            try:
                action = read_reply(text, shot.width, shot.height, lenient=True)
            except ActionParseError:
                continue  # an empty reply: look again
            if action.name == "finished":
                return action.params["text"]
            await episode.box.act(to_gym_action(action))
    return None
