"""Tokens in against text in, on the BPE tiny model: prefix breaks, trained turns, added latency.

Starts a vLLM CPU server (cua-rl's module, ``--enable-scale-out``), the sim gym and the sim agent,
and runs the same episodes through ``CUAAgentWorkflow`` twice, sampled freely (no constraint,
temperature 1.0):

- text in (``endpoint.mode=direct``): the agent sends its history as text to vLLM's chat
  completions and reports the token ids and logprobs; the row is built from its events, and a
  turn whose prompt does not start with the previous prompt + sampled ids is a prefix break;
- tokens in (``endpoint.mode=gateway``): the agent's calls go through the rollout gateway, which
  extends the ids it served and samples on vLLM's tokens-in endpoint.

Per mode: prefix breaks, trained turns and trained tokens per episode (means), episodes kept.

Then the gateway's added latency: the same kind of conversation (a system prompt, one screenshot
and a line of text per turn, the model's replies sent back as text; every call samples exactly
``--tokens`` tokens) sent to vLLM's chat completions directly and through the gateway,
alternating call by call; p50/p95 per call for each, and the difference.

    python bench/gateway_tokens.py [--episodes 8] [--turns 4] [--conversations 12] [--tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from cua_rl.testing.model_standin import StaticEngine as Engine  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def episodes(mode: str, args, gym, agent, vllm, model_dir) -> dict[str, float]:
    from areal.infra import workflow_context

    from cua_rl.agent.service_driver import DriverConfig
    from cua_rl.app.config import (
        AgentSection,
        EndpointSection,
        GymSection,
        WorkflowSettings,
    )
    from cua_rl.clients.genv import GenvClient
    from cua_rl.gateway import Sampling
    from cua_rl.reward import RewardConfig
    from cua_rl.rollout.workflow import CUAAgentWorkflow
    from cua_rl.tasks import load_tasks_gym, task_row
    from cua_rl.trajectory.config import TrajectoryConfig

    class Keeping(CUAAgentWorkflow):
        results: list = []

        async def build_rows(self, task, calls, reward):
            result = await super().build_rows(task, calls, reward)
            self.results.append(result.stats)
            return result

    workflow_context.set(workflow_context.WorkflowContext(is_eval=False))
    async with GenvClient(gym.url, gym.gym_id) as client:
        tasks = await load_tasks_gym(client)
    task = task_row(next(t for t in tasks if "easy" in t.tags))
    options = {"parse": "lenient", "logprobs": mode == "direct", "maxTokens": args.tokens}
    settings = WorkflowSettings(
        gym=GymSection(base_url=gym.url, gym_id=gym.gym_id),
        agent=AgentSection(
            base_url=agent.url,
            agent="sim",
            max_steps=args.turns,
            max_run_time_s=600,
            model_options=options,
            driver=DriverConfig(deadline_s=600),
        ),
        endpoint=EndpointSection(mode=mode, model_name=vllm.model),
        trajectory=TrajectoryConfig(),
        reward=RewardConfig(),
        processor_path=str(model_dir),
        sampling=Sampling(temperature=1.0, max_new_tokens=args.tokens),
    )
    wf = Keeping(settings)
    Keeping.results = []
    engine = Engine(f"{vllm.host}:{vllm.port}")
    try:
        rows = await asyncio.gather(
            *(wf.arun_episode(engine, dict(task)) for _ in range(args.episodes))
        )
    finally:
        await wf.aclose()
    stats = Keeping.results
    n = max(len(stats), 1)
    return {
        "episodes": float(len(stats)),
        "kept": float(sum(r is not None for r in rows)),
        "turns": sum(s.get("turns", 0) for s in stats) / n,
        "breaks": sum(s.get("prefix_breaks", 0) for s in stats) / n,
        "trained_turns": sum(s.get("trained_turns", 0) for s in stats) / n,
        "trained_tokens": sum(s.get("trained_tokens", 0) for s in stats) / n,
    }


def _screenshot(i: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 240), ((37 * i) % 256, 120, (200 - 23 * i) % 256)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def latency(args, vllm, processor) -> dict[str, list[float]]:
    import httpx

    from cua_rl.gateway import Gateway, GatewayConfig, Sampling, SessionSpec
    from cua_rl.trajectory.config import TrajectoryConfig

    gateway = Gateway(GatewayConfig()).start()
    engine = Engine(f"{vllm.host}:{vllm.port}")
    sampling = Sampling(temperature=1.0, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    direct_body = {"temperature": 1.0, "max_tokens": args.tokens, "min_tokens": args.tokens}
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            for c in range(args.conversations):
                url = gateway.open(
                    f"bench-{c}",
                    SessionSpec(engine, sampling, processor, vllm.model, TrajectoryConfig()),
                )
                history = {
                    mode: [{"role": "system", "content": "You operate a phone."}] for mode in times
                }
                for turn in range(args.turns):
                    shot = _screenshot(c * args.turns + turn)
                    for mode, base, extra in (
                        ("direct", vllm.base_url, direct_body),
                        ("gateway", url, {}),
                    ):
                        msgs = history[mode]
                        msgs.append(
                            {
                                "role": "user",
                                "content": [
                                    {"type": "text", "text": f"Step {turn + 1}: what next?"},
                                    {"type": "image_url", "image_url": {"url": shot}},
                                ],
                            }
                        )
                        body = {"model": vllm.model, "messages": msgs, **extra}
                        t0 = time.perf_counter()
                        r = await http.post(f"{base}/chat/completions", json=body)
                        took = time.perf_counter() - t0
                        r.raise_for_status()
                        reply = r.json()["choices"][0]["message"]["content"]
                        msgs.append({"role": "assistant", "content": reply})
                        if c or turn:  # the very first calls warm vLLM up
                            times[mode].append(took)
                gateway.close(f"bench-{c}")
    finally:
        gateway.stop()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()

    from transformers import AutoProcessor

    from cua_rl.sim.agent import AgentServer
    from cua_rl.sim.gym import GymServer
    from cua_rl.testing.cache import ensure_model
    from cua_rl.testing.vllm_server import VLLMServer

    model_dir = ensure_model("qwen2-vl-bpe")
    processor = AutoProcessor.from_pretrained(model_dir)
    print(f"[bench] starting vLLM CPU with {model_dir.name} ...", flush=True)
    with VLLMServer(model_dir) as vllm, GymServer() as gym, AgentServer() as agent:
        rows = {}
        for mode in ("direct", "gateway"):
            print(f"[bench] {args.episodes} episodes of {args.turns} turns, {mode} ...", flush=True)
            rows[mode] = asyncio.run(episodes(mode, args, gym, agent, vllm, model_dir))
        print(f"[bench] latency: {args.conversations} conversations of {args.turns} turns ...")
        times = asyncio.run(latency(args, vllm, processor))

    print()
    print(f"{'per episode':<22}{'kept':>6}{'turns':>8}{'breaks':>8}{'trained turns':>15}", end="")
    print(f"{'trained tokens':>16}")
    names = {"direct": "text in (direct)", "gateway": "tokens in (gateway)"}
    for mode, r in rows.items():
        print(
            f"{names[mode]:<22}{r['kept']:>3.0f}/{r['episodes']:<2.0f}{r['turns']:>8.2f}"
            f"{r['breaks']:>8.2f}{r['trained_turns']:>15.2f}{r['trained_tokens']:>16.1f}"
        )
    d, g = rows["direct"], rows["gateway"]
    if d["trained_turns"]:
        print(f"trained turns, tokens in / text in: {g['trained_turns'] / d['trained_turns']:.2f}x")
    print()
    print(f"{'per call (ms)':<22}{'n':>5}{'p50':>9}{'p95':>9}{'mean':>9}")
    for mode, values in times.items():
        ms = [v * 1000 for v in values]
        print(
            f"{names[mode]:<22}{len(ms):>5}{_percentile(ms, 0.5):>9.1f}"
            f"{_percentile(ms, 0.95):>9.1f}{statistics.fmean(ms):>9.1f}"
        )
    dp50 = _percentile(times["gateway"], 0.5) - _percentile(times["direct"], 0.5)
    dp95 = _percentile(times["gateway"], 0.95) - _percentile(times["direct"], 0.95)
    print(f"gateway added: p50 {dp50 * 1000:+.1f} ms, p95 {dp95 * 1000:+.1f} ms per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
