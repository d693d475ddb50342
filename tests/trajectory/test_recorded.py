"""Rows from event logs recorded against real vLLM CPU (tiny Qwen2-VL), checked end to end.

Expected values are read from the raw event JSON (vLLM's own fields), from a transformers
forward pass of the same model, or from AReaL's own code, never from the converter.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch

from cua_rl.rollout import groups
from cua_rl.rollout.groups import GroupSettings
from cua_rl.testing.forward import load_vl_model, trained_gap
from cua_rl.trajectory import TrajectoryConfig, convert_events

from .conftest import open_executions, record

pytestmark = pytest.mark.slow


def _raw_turns(events):
    """(prompt_token_ids, token_ids, logprobs) per model_output, straight from vLLM's JSON."""
    out = []
    for ev in events:
        if ev["type"] == "model_output":
            o = ev["modelOutput"]
            c = o["choices"][0]
            out.append(
                (
                    o["prompt_token_ids"],
                    c["token_ids"],
                    [x["logprob"] for x in c["logprobs"]["content"]],
                )
            )
    return out


def _expected_segment_start(raw):
    """Index of the first turn of the last prefix-consistent run (by direct comparison)."""
    start = 0
    for t in range(1, len(raw)):
        prev = raw[t - 1][0] + raw[t - 1][1]
        if raw[t][0][: len(prev)] != prev:
            start = t
    return start


@pytest.fixture(scope="module")
def byte_rows(recorded_logs, processor):
    rows = []
    for i, events in enumerate(recorded_logs):
        res = convert_events(events, processor=processor, reward=float(i == 0), version=5)
        assert res.ok, (res.reason, res.detail)
        rows.append(res)
    return rows


def _n_breaks(raw):
    return sum(
        raw[t][0][: len(raw[t - 1][0] + raw[t - 1][1])] != raw[t - 1][0] + raw[t - 1][1]
        for t in range(1, len(raw))
    )


def test_byte_model_rows_merge_turns(recorded_logs, byte_rows):
    merged_turns = 0
    for events, res in zip(recorded_logs, byte_rows, strict=True):
        raw = _raw_turns(events)
        assert len(raw) >= 1
        breaks = _n_breaks(raw)
        assert res.stats["prefix_breaks"] == breaks
        # Every turn is trained: a row per run of turns that extend one another.
        assert len(res.rows) == res.stats["rows"] == breaks + 1
        assert res.stats["trained_turns"] == len(raw)
        merged_turns += len(raw) - len(res.rows)
    # ASCII-constrained sampling on the byte tokenizer keeps the prefix property, so most turns
    # of the three 4-step runs land in merged rows (a reply ended by <|endoftext|> still breaks).
    assert merged_turns > len(byte_rows)


def test_trained_tokens_are_the_sampled_ids_and_logprobs(recorded_logs, byte_rows):
    for events, res in zip(recorded_logs, byte_rows, strict=True):
        raw = _raw_turns(events)
        trained_ids, trained_lp = [], []
        for row in res.rows:  # in turn order
            mask = row["loss_mask"][0].bool()
            trained_ids += row["input_ids"][0][mask].tolist()
            trained_lp += row["logprobs"][0][mask].tolist()
            assert set(row["versions"][0][mask].tolist()) == {5}
            assert set(row["versions"][0][~mask].tolist()) == {-1}
            assert (row["logprobs"][0][~mask] == 0).all()
        assert trained_ids == [t for _, ids, _ in raw for t in ids]
        want_lp = torch.tensor([x for _, _, lps in raw for x in lps], dtype=torch.float32)
        assert trained_lp == want_lp.tolist()


def test_prompt_part_is_the_last_prompt_token_ids(recorded_logs, byte_rows):
    for events, res in zip(recorded_logs, byte_rows, strict=True):
        prompt, ids, _ = _raw_turns(events)[-1]
        row_ids = res.rows[-1]["input_ids"][0].tolist()
        assert row_ids[: len(prompt)] == prompt
        assert row_ids[len(prompt) :] == ids


def test_images_match_the_prompt(recorded_logs, byte_rows, processor):
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for res in byte_rows:
        # One screenshot per step, and the agent keeps them all: the last prompt holds each.
        last = res.rows[-1]["multi_modal_input"][0]["image_grid_thw"]
        assert last.shape == (res.stats["turns"], 3)
        for row in res.rows:
            grid = row["multi_modal_input"][0]["image_grid_thw"]
            assert int((row["input_ids"] == pad).sum()) == int(grid.prod(-1).sum()) // 4
            assert torch.equal(row["mm_token_type_ids"].bool(), row["input_ids"] == pad)
            pixels = row["multi_modal_input"][0]["pixel_values"]
            assert pixels.shape[0] == int(grid.prod(-1).sum())


@pytest.fixture(scope="module")
def hf_model(tiny_vl_model_dir):
    return load_vl_model(tiny_vl_model_dir)


def _ascii_allowed(processor) -> list[int]:
    """What the local agent's ``constrain: ascii`` allows: single-token printable ASCII and
    <|im_end|> (cua_rl/sim/agent/service.py), from the tokenizer itself."""
    tok = processor.tokenizer
    ids = {
        t[0] for c in range(32, 127) if len(t := tok.encode(chr(c), add_special_tokens=False)) == 1
    }
    return sorted({*ids, tok.convert_tokens_to_ids("<|im_end|>")})


def test_logprob_agreement_with_transformers(byte_rows, hf_model, processor):
    """The servers run with --logprobs-mode processed_logprobs: the recorded logprobs are those
    of the distribution sampled from, here the model restricted to the allowed ids."""
    allowed = _ascii_allowed(processor)
    for row in (row for res in byte_rows for row in res.rows):
        diff = trained_gap(hf_model, row, allowed=allowed)
        assert diff.max().item() < 1e-3, f"max |Δlogprob| {diff.max().item():.2e} over {len(diff)}"
        # Not the unrestricted model's: the restriction is in the recorded numbers.
        assert trained_gap(hf_model, row).mean().item() > 0.1


def test_regex_constrained_logprobs_are_of_the_masked_distribution(
    agent_stack, vllm_server, processor, hf_model
):
    """Why the config refuses constrain=regex with decoupled PPO: vLLM applies the structured-
    output grammar mask before it computes logprobs, so what it records is not the model's."""
    runs = asyncio.run(record(agent_stack, vllm_server, steps=2, seed=5, constrain="regex"))
    res = convert_events(runs[0].events, processor=processor, reward=0.0, version=0)
    assert res.ok, (res.reason, res.detail)
    diff = trained_gap(hf_model, res.row)
    # Where the grammar leaves one choice the masked logprob is 0 while the model's is about
    # -log(vocab): far beyond the 1e-3 the unmasked (ascii) runs agree to.
    assert diff.mean().item() > 0.5, diff


def test_areal_accepts_rows(byte_rows):
    from areal.infra.workflow_executor import check_trajectory_format
    from areal.utils.data import concat_padded_tensors

    rows = [row for res in byte_rows for row in res.rows]
    keys = set(rows[0])
    for row in rows:
        assert check_trajectory_format(row, batch_size=1, expected_keys=keys)
    for res in byte_rows:  # an episode's rows, as the workflow returns them
        batch = res.row
        assert check_trajectory_format(batch, batch_size=len(res.rows), expected_keys=keys)
    batch = concat_padded_tensors(rows)
    assert check_trajectory_format(batch, batch_size=len(rows), expected_keys=keys)
    lens = [r["input_ids"].shape[1] for r in rows]
    assert batch["input_ids"].shape == (len(rows), max(lens))
    assert batch["attention_mask"].sum(-1).tolist() == lens
    assert len(batch["multi_modal_input"]) == len(rows)
    assert batch["rewards"].shape == (len(rows),)


class _ReplayWorkflow:
    """Hand-written workflow: each call converts the next recorded log (as arun_episode would)."""

    def __init__(self, logs, processor, rewards, drop=()):
        self.logs, self.processor, self.rewards, self.drop = logs, processor, rewards, set(drop)
        self.calls = 0

    async def arun_episode(self, engine, data):
        i = self.calls
        self.calls += 1
        await asyncio.sleep(0)
        if i in self.drop:
            return None
        res = convert_events(
            self.logs[i],
            processor=self.processor,
            reward=self.rewards[i],
            version=1,
            episode_id=i + 1,
        )
        return res.row


async def test_grouped_workflow_and_advantages(recorded_logs, processor):
    from areal.api.cli_args import PPOActorConfig
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
    from areal.infra.workflow_executor import check_trajectory_format
    from areal.trainer.ppo.actor import PPOActor

    n = len(recorded_logs)
    rewards = [1.0] + [0.0] * (n - 1)
    inner = _ReplayWorkflow(recorded_logs, processor, rewards)
    grouped = GroupedRolloutWorkflow(inner, group_size=n, logger=logging.getLogger("test"))
    batch = await grouped.arun_episode(engine=None, data={"task_id": "sim-001"})
    assert inner.calls == n
    episode = batch["episode_id"].tolist()
    assert check_trajectory_format(batch, batch_size=len(episode))
    assert batch["rewards"].tolist() == [rewards[e - 1] for e in episode]
    # The group filter normalises per episode in the rollout worker; AReaL's reward_norm is off.
    assert groups.GroupFilter(GroupSettings(size=n)).complete_groups(batch)

    cfg = PPOActorConfig(
        kl_ctl=0.0,
        discount=1.0,
        gae_lambda=1.0,
        adv_norm=None,
        reward_norm=None,
        reward_bias=0.0,
        reward_scaling=1.0,
        reward_clip=20.0,
        recompute_logprob=False,
        use_decoupled_loss=False,
    )
    actor = PPOActor(cfg, engine=None)
    data = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    out = actor.compute_advantages([data])[0] if isinstance(data, dict) else None
    adv = out["advantages"]
    mask = out["loss_mask"].bool()  # AReaL rolled it by -1: position t predicts token t+1
    # GRPO-style: with discount 1, lambda 1 and no KL, every trained position of an episode
    # carries its group-normalised reward; the solved episode is above the group, the rest below.
    # Each episode counts once, however many rows it has.
    per_episode: dict[int, list[torch.Tensor]] = {}
    for i, e in enumerate(episode):
        a = adv[i][mask[i]]
        assert a.numel() == int(batch["loss_mask"][i].sum())
        per_episode.setdefault(e, []).append(a)
    assert len(per_episode) == n
    values = []
    for e, parts in per_episode.items():
        a = torch.cat(parts)
        assert torch.allclose(a, a[0].expand_as(a))
        assert (a[0] > 0) if rewards[e - 1] > 0 else (a[0] < 0)
        values.append(a[0])
    assert torch.stack(values).sum().abs().item() < 1e-4


async def test_grouped_workflow_drops_failed_members(recorded_logs, processor):
    from areal.infra.remote_inf_engine import GroupedRolloutWorkflow

    inner = _ReplayWorkflow(recorded_logs, processor, [0.0] * 3, drop={1})
    grouped = GroupedRolloutWorkflow(inner, group_size=3, logger=logging.getLogger("test"))
    batch = await grouped.arun_episode(engine=None, data={})
    # AReaL keeps the incomplete group: the workflow's dynamic_filter_fn must catch this.
    assert set(batch["episode_id"].tolist()) == {1, 3}
    assert not groups.GroupFilter(GroupSettings(size=3)).complete_groups(batch)


def test_bpe_prefix_break_follows_policy(bpe_logs, bpe_processor):
    breaks = checked = 0
    for events in bpe_logs:
        raw = _raw_turns(events)
        start = _expected_segment_start(raw)
        n_breaks = _n_breaks(raw)
        breaks += n_breaks
        res = convert_events(events, processor=bpe_processor, reward=1.0, version=2)
        assert res.stats["prefix_breaks"] == n_breaks
        if res.reason == "image_token_in_output":
            continue  # unconstrained sampling may emit <|image_pad|>: rejected, counted
        assert res.ok, (res.reason, res.detail)
        checked += 1
        prompt, ids, _ = raw[-1]
        assert res.rows[-1]["input_ids"][0].tolist() == prompt + ids
        first_of_last = res.rows[-1]["input_ids"][0][: len(raw[start][0])].tolist()
        assert first_of_last == raw[start][0]  # the last row starts where the last run starts
        trained = [
            t for row in res.rows for t in row["input_ids"][0][row["loss_mask"][0].bool()].tolist()
        ]
        assert trained == [t for _, out, _ in raw for t in out]
        assert res.stats["trained_turns"] == len(raw) and len(res.rows) == n_breaks + 1

        rej = convert_events(
            events,
            processor=bpe_processor,
            reward=1.0,
            version=2,
            config=TrajectoryConfig(prefix_break_policy="reject"),
        )
        if n_breaks:
            assert rej.row is None and rej.reason == "prefix_break"
        else:
            assert rej.ok
    assert breaks > 0, "sampling with the BPE tokenizer should have broken the prefix at least once"
    assert checked > 0, "every BPE log was rejected for sampled image tokens: nothing was checked"


def test_log_without_logprobs_is_rejected(agent_stack, vllm_server, processor):
    (run,) = asyncio.run(
        record(agent_stack, vllm_server, steps=2, seed=7, constrain="ascii", logprobs=False)
    )
    assert open_executions(agent_stack) == []
    events = run.events
    out = next(e for e in events if e["type"] == "model_output")["modelOutput"]
    # The real answer, without the token fields the agent did not request.
    assert out.get("prompt_token_ids") is None and out["choices"][0].get("logprobs") is None
    res = convert_events(events, processor=processor, reward=1.0, version=0)
    assert res.row is None and res.reason == "missing_tokens"


def test_retokenize_fallback_reproduces_vllm_prompt(recorded_logs, processor):
    # Strip the token data from a real log; the fallback must rebuild vLLM's exact ids.
    events = copy.deepcopy(recorded_logs[0])
    raw = _raw_turns(recorded_logs[0])
    for ev in events:
        if ev["type"] == "model_output":
            out = ev["modelOutput"]
            out.pop("prompt_token_ids")
            out["choices"][0].pop("token_ids")
            out["choices"][0].pop("logprobs")
    cfg = TrajectoryConfig(missing_tokens_policy="retokenize", trainer_recomputes_logprobs=True)
    res = convert_events(events, processor=processor, reward=0.0, version=0, config=cfg)
    assert res.ok, (res.reason, res.detail)
    prompt, ids, _ = raw[-1]
    assert res.row["input_ids"][0].tolist()[: len(prompt)] == prompt
    assert res.stats["retokenized_turns"] == len(raw)
    assert (res.row["logprobs"] == 0).all()  # placeholders the trainer must recompute


async def test_screenshots_by_url_fetched_from_the_gym(agent_stack, vllm_server, processor):
    from cua_rl.trajectory import (
        convert_turns,
        events_to_turns,
        fetch_images,
        image_urls_needed,
    )

    (run,) = await record(
        agent_stack, vllm_server, steps=2, seed=11, constrain="ascii", imageMode="url"
    )
    assert open_executions(agent_stack) == []
    parsed = events_to_turns(run.events)
    urls = image_urls_needed(parsed.turns)
    assert urls and all(u.startswith("http://127.0.0.1:") for u in urls)
    # Not allowed by default: refused before any request.
    strict = TrajectoryConfig()
    res = convert_turns(parsed.turns, processor=processor, reward=0.0, version=0, config=strict)
    assert res.reason == "image_url_refused"
    cfg = TrajectoryConfig(allowed_image_hosts=("127.0.0.1",), allow_http=True)
    # Screenshots stay fetchable after terminate (like presigned URLs).
    fetched = await fetch_images(urls, cfg)
    assert set(fetched) == set(urls)
    res = convert_turns(
        parsed.turns, processor=processor, reward=0.0, version=0, config=cfg, fetched_images=fetched
    )
    assert res.ok, (res.reason, res.detail)
    prompt, ids, _ = _raw_turns(run.events)[-1]
    assert res.row["input_ids"][0].tolist() == prompt + ids
    assert res.stats["images"] == len(urls)


def test_reward_from_the_recorded_gym_evaluation(recorded_runs):
    from cua_rl.reward import EpisodeFacts, RewardConfig, compute_reward
    from cua_rl.trajectory import events_to_turns

    cfg = RewardConfig(shaping=[{"name": "step_cost", "cost": 0.01}])
    for run in recorded_runs:
        assert run.evaluation is not None, run.evaluation_error
        result = run.evaluation["result"]
        parsed = events_to_turns(run.events)
        out = compute_reward(run.evaluation, EpisodeFacts.from_turns(parsed.turns), cfg)
        # The gym's weighted score, recomputed here from its validator entries.
        vals = result["validators"]
        weighted = sum(v["weight"] * v["pass"] for v in vals) / sum(v["weight"] for v in vals)
        assert out.base == pytest.approx(weighted)
        assert out.success is result["success"]
        assert out.reward == pytest.approx(weighted - 0.01 * len(_raw_turns(run.events)))


def test_cli_converts_a_recorded_log(recorded_runs, tiny_vl_model_dir, tmp_path):
    import json
    import subprocess
    import sys

    run = recorded_runs[0]
    log = run.save(tmp_path / "run.json")
    out = tmp_path / "row.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "cua_rl.trajectory", "convert", "--events", str(log),
         "--processor", str(tiny_vl_model_dir), "--out", str(out), "--version", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    raw = _raw_turns(run.events)
    prompt, ids, _ = raw[-1]
    start = _expected_segment_start(raw)
    assert summary["turns"] == len(raw)
    assert summary["row_len"] == len(prompt) + len(ids)
    assert summary["trained_tokens"] == sum(len(o) for _, o, _ in raw[start:])
    last_call = [e for e in run.events if e["type"] == "model_call"][-1]
    n_images = sum(
        1
        for m in last_call["modelSpecificInput"]["messages"]
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") in ("image_url", "image")
    )
    assert summary["images"] == n_images > 0
    assert summary["prefix_breaks"] == _n_breaks(raw)
    assert summary["rejected"] is None
    row = torch.load(out, weights_only=False)
    assert row["input_ids"][0].tolist() == prompt + ids
    assert set(row["versions"][0][row["loss_mask"][0].bool()].tolist()) == {3}
