"""Record real agent runs (gym + agent + model server) as event logs, for tests, demos and benches.

One recorded run is what one training episode sees: a gym execution created through
:class:`cua_rl.clients.genv.GenvClient` (terminated on every exit, so nothing leaks even when the
run or the evaluation fails), one mini-agent run followed to its end by
:class:`cua_rl.agent.service_driver.RunDriver` (which fetches the events once more after the run
is terminal), and the gym's raw evaluation answer for the final state. Runs are sequential: the
point is faithful logs, not throughput, and the tiny CPU model server serves one request at a
time well.

The logs are the agent's own events, so they can be saved (``RecordedRun.log()``) and fed to
``python -m cua_rl.trajectory convert``. ``python -m cua_rl.testing.record --out DIR`` starts the
local gym, the local agent and vLLM with a tiny model and writes ``run-<i>.json`` files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cua_rl.agent.service_driver import DriverConfig, RunDriver
from cua_rl.agent.spec import RunSpec
from cua_rl.clients.gbox_mini_agent import MiniAgentClient
from cua_rl.clients.genv import GenvClient, GenvTimeouts
from cua_rl.errors import GymError

# Settings that make a log trainable and checkable: vLLM token data, temperature 1.0 (vLLM's
# logprobs are of the raw model distribution; at 1.0 they are also the sampling distribution).
DEFAULT_MODEL_OPTIONS = {"logprobs": True, "temperature": 1.0, "maxTokens": 12}


@dataclass
class RecordedRun:
    """One episode's raw material: the agent's events and the gym's evaluation."""

    task_id: str
    execution_id: str
    run_id: str | None
    status: str
    reason: str | None
    answer: str | None
    events: list[dict]
    evaluation: dict | None = None  # the raw evaluate answer (None: not asked or it failed)
    evaluation_error: str | None = None
    model_options: dict = field(default_factory=dict)

    def log(self) -> dict:
        """A JSON object with an ``events`` list (the converter CLI's input) and the context."""
        return {
            "task_id": self.task_id,
            "execution_id": self.execution_id,
            "run_id": self.run_id,
            "status": self.status,
            "reason": self.reason,
            "answer": self.answer,
            "evaluation": self.evaluation,
            "evaluation_error": self.evaluation_error,
            "model_options": self.model_options,
            "events": self.events,
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.log()))
        return path


async def record_run(
    genv: GenvClient,
    agent: MiniAgentClient,
    task: Mapping[str, Any],
    *,
    model_url: str,
    model_name: str,
    steps: int = 4,
    seed: int = 0,
    model_options: Mapping[str, Any] | None = None,
    deadline_s: float = 300.0,
    evaluate: bool = True,
    agent_flavour: str = "qwen3-vl",
) -> RecordedRun:
    """Run ``task`` once on a fresh execution (always terminated) and return its log."""
    task_id = str(task["task_id"])
    options = {**DEFAULT_MODEL_OPTIONS, "seed": seed, **dict(model_options or {})}
    async with genv.execution(task_id, {"seed": seed}) as handle:
        spec = RunSpec(
            task=str(task.get("description") or task.get("instruction") or task_id),
            model_base_url=model_url,
            model_name=model_name,
            gym_base_url=genv.base.rsplit("/api/v1/", 1)[0],
            gym_id=genv.gym_id,
            execution_id=handle.execution_id,
            agent=agent_flavour,
            max_steps=steps,
            max_run_time_s=deadline_s,
            model_options=options,
        )
        result = await RunDriver(agent, DriverConfig(deadline_s=deadline_s + 30.0)).run(spec)
        summary = result.summary
        evaluation = evaluation_error = None
        if evaluate:
            try:
                answer = await handle.evaluate(answer_text=summary.answer)
                evaluation = answer.raw
            except GymError as exc:
                evaluation_error = str(exc)
        return RecordedRun(
            task_id=task_id,
            execution_id=handle.execution_id,
            run_id=summary.run_id,
            status=summary.status,
            reason=summary.reason,
            answer=summary.answer,
            events=result.events,
            evaluation=evaluation,
            evaluation_error=evaluation_error,
            model_options=options,
        )


async def record_runs(
    gym_url: str,
    gym_id: str,
    agent_url: str,
    model_url: str,
    model_name: str,
    *,
    tasks: Sequence[str | Mapping[str, Any]] | None = None,
    n: int = 3,
    steps: int = 4,
    seed: int = 0,
    model_options: Mapping[str, Any] | None = None,
    deadline_s: float = 300.0,
    evaluate: bool = True,
    client: httpx.AsyncClient | None = None,
) -> list[RecordedRun]:
    """Record ``n`` runs one after the other; run ``i`` uses ``tasks[i % len(tasks)]`` and seed
    ``seed + i`` (the gym's initial state and the model's sampling seed).

    ``gym_url`` is the gym server root (no ``/api/v1``); ``tasks`` are task ids or task objects,
    default the gym's task list in its order. ``model_options`` are merged into the run's model
    object (e.g. ``{"constrain": "ascii"}``, ``{"imageMode": "url"}``, ``{"logprobs": False}``).
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    own = client is None
    client = client or httpx.AsyncClient(timeout=httpx.Timeout(60.0))
    timeouts = GenvTimeouts(create_s=60.0, create_grace_s=30.0, terminate_budget_s=30.0)
    genv = GenvClient(gym_url, gym_id, client=client, timeouts=timeouts)
    agent = MiniAgentClient(agent_url, client=client)
    try:
        if tasks is None:
            task_objs: list[Mapping[str, Any]] = await genv.list_tasks()
        else:
            task_objs = [await genv.get_task(t) if isinstance(t, str) else dict(t) for t in tasks]
        if not task_objs:
            raise ValueError("no tasks to record")
        runs = []
        for i in range(n):
            runs.append(
                await record_run(
                    genv,
                    agent,
                    task_objs[i % len(task_objs)],
                    model_url=model_url,
                    model_name=model_name,
                    steps=steps,
                    seed=seed + i,
                    model_options=model_options,
                    deadline_s=deadline_s,
                    evaluate=evaluate,
                )
            )
        return runs
    finally:
        # Waits (bounded) for the terminate of any create that answered after its deadline.
        await genv.aclose()
        if own:
            await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cua_rl.testing.record",
        description="record agent runs: local gym + local agent + vLLM CPU with a tiny model",
    )
    parser.add_argument("--out", required=True, help="folder for run-<i>.json event logs")
    parser.add_argument("--n", type=int, default=3, help="number of runs")
    parser.add_argument("--steps", type=int, default=4, help="maxSteps per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first run")
    parser.add_argument(
        "--model", default="qwen2-vl-byte", help="tiny model kind (cua_rl.testing.models)"
    )
    parser.add_argument(
        "--constrain", default="ascii", choices=("ascii", "regex", "none"),
        help="agent-side sampling constraint ('ascii' keeps the byte model's prefix property)",
    )  # fmt: skip
    parser.add_argument("--image-mode", default="data", choices=("data", "url"))
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    from cua_rl.sim.agent import AgentServer
    from cua_rl.sim.gym import GymServer
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.vllm_server import VLLMServer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"imageMode": args.image_mode, "maxTokens": args.max_tokens}
    if args.constrain != "none":
        options["constrain"] = args.constrain
    model_dir = ensure_model(args.model)
    with (
        VLLMServer(model_dir, model=args.model) as vllm,
        GymServer() as gym,
        AgentServer() as agent,
    ):
        runs = asyncio.run(
            record_runs(
                gym.url, gym.gym_id, agent.url, vllm.base_url, vllm.model,
                n=args.n, steps=args.steps, seed=args.seed, model_options=options,
            )
        )  # fmt: skip
    for i, run in enumerate(runs):
        path = run.save(out / f"run-{i}.json")
        turns = sum(1 for e in run.events if e.get("type") == "model_output")
        score = ((run.evaluation or {}).get("result") or {}).get("score")
        print(
            json.dumps(
                {"file": str(path), "status": run.status, "reason": run.reason,
                 "turns": turns, "score": score, "evaluation_error": run.evaluation_error}
            )
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
