"""Two PPO steps of AReaL's real PPOTrainer on CPU: ``python -m cua_rl.cpu.smoke``.

The check that AReaL, the vLLM CPU build and ``enable_cpu_training`` still work together. It
builds the tiny text Qwen2 (``cua_rl.testing.models``), writes an AReaL config into the run folder,
and trains with a single-turn workflow: the prompt goes through the chat template, vLLM samples
a completion with logprobs, and the reward is the share of lowercase ASCII letters in the
completion (so samples of one group differ). Each committed step is appended to
``RUN_DIR/steps.jsonl`` and printed on one line. The exit status is 0 only if every step was
committed. It trains with selective logits (``cua_rl.areal.logits``, as train.py does by
default) unless ``--full-logits`` asks for AReaL's logits path.
"""

import argparse
import json
import math
import sys
import time
import uuid
from pathlib import Path

import torch
from areal.api import ModelRequest, RolloutWorkflow
from areal.api.cli_args import GenerationHyperparameters

_CONFIG = """
experiment_name: cua-areal-smoke
trial_name: t0
seed: 1
enable_offload: false
total_train_epochs: 1
total_train_steps: {steps}
tokenizer_path: {model}
cluster:
  n_nodes: 1
  n_gpus_per_node: 1
  fileroot: {run_dir}/fileroot
  name_resolve: {{type: nfs, nfs_record_root: {run_dir}/name_resolve}}
scheduler: {{type: local}}
rollout:
  backend: "vllm:d1"
  experiment_name: cua-areal-smoke
  trial_name: t0
  max_concurrent_rollouts: 4
  consumer_batch_size: 2
  max_head_offpolicyness: 1
  check_trajectory_format: true
  setup_timeout: {setup_timeout}
  request_timeout: 120
gconfig: {{n_samples: 2, min_new_tokens: 1, max_new_tokens: 16, greedy: false, temperature: 1.0}}
actor:
  backend: "fsdp:d1"
  experiment_name: cua-areal-smoke
  trial_name: t0
  path: {model}
  dtype: float32
  attn_impl: sdpa
  disable_dropout: true
  mb_spec: {{max_tokens_per_mb: 4096}}
  optimizer: {{type: adam, lr: 1.0e-4, weight_decay: 0.0, lr_scheduler_type: constant, gradient_clipping: 1.0}}
  reward_norm: {{mean_level: group, std_level: group, group_size: 2}}
  adv_norm: {{mean_level: batch, std_level: batch}}
  kl_ctl: 0.0
  ppo_n_minibatches: 1
  recompute_logprob: true
  use_decoupled_loss: true
  weight_update_mode: disk
vllm: {{model: {model}, seed: 1, dtype: float32, max_model_len: 1024, max_num_seqs: 8, enforce_eager: true}}
train_dataset: {{batch_size: 2, shuffle: true, pin_memory: false, num_workers: 0, path: unused, type: rl}}
saver: {{experiment_name: cua-areal-smoke, trial_name: t0, fileroot: {run_dir}/fileroot}}
recover: {{mode: disabled, experiment_name: cua-areal-smoke, trial_name: t0, fileroot: {run_dir}/fileroot}}
evaluator: {{experiment_name: cua-areal-smoke, trial_name: t0, fileroot: {run_dir}/fileroot}}
stats_logger: {{experiment_name: cua-areal-smoke, trial_name: t0, fileroot: {run_dir}/fileroot}}
"""

PROMPTS = [
    "say hello",
    "count to three",
    "name a colour",
    "spell cat",
    "what is up",
    "write a word",
]
# Stats worth a line per step; the full set is in RUN_DIR/steps.jsonl.
SUMMARY = {
    "reward": "ppo_actor/task_reward/avg",
    "tokens": "ppo_actor/n_valid_tokens",
    "grad_norm": "ppo_actor/update/grad_norm",
    # Per-token vLLM logprob minus trainer logprob, extremes over the batch (AReaL's
    # compute_logp/kl_div_direct = old_logp - logp); 0 when both see the same weights.
    "gap_min": "ppo_actor/update/compute_logp/kl_div_direct/min",
    "gap_max": "ppo_actor/update/compute_logp/kl_div_direct/max",
    "rollout_s": "timeperf/rollout",
    "train_s": "timeperf/train_step",
    "update_weights_s": "timeperf/update_weights",
}


def lowercase_share(text: str) -> float:
    return sum(c.isascii() and c.islower() for c in text) / max(1, len(text))


class OneTurnWorkflow(RolloutWorkflow):
    """Prompt -> one sampled completion -> one training row."""

    def __init__(self, gconfig: GenerationHyperparameters, tokenizer_path: str):
        from areal.utils.hf_utils import load_hf_tokenizer

        self.tokenizer = load_hf_tokenizer(tokenizer_path)
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(self.tokenizer)

    async def arun_episode(self, engine, data):
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": data["prompt"]}], tokenize=True, add_generation_prompt=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=ids,
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)
        reward = lowercase_share(self.tokenizer.decode(resp.output_tokens))
        n_in, n_out = resp.input_len, resp.output_len
        row = {
            "input_ids": torch.tensor(resp.input_tokens + resp.output_tokens, dtype=torch.long),
            "loss_mask": torch.tensor([0] * n_in + [1] * n_out, dtype=torch.int32),
            "logprobs": torch.tensor([0.0] * n_in + resp.output_logprobs, dtype=torch.float32),
            "versions": torch.tensor([-1] * n_in + resp.output_versions, dtype=torch.int32),
            "attention_mask": torch.ones(n_in + n_out, dtype=torch.bool),
            "rewards": torch.tensor(reward, dtype=torch.float32),
        }
        return {k: v.unsqueeze(0) for k, v in row.items()}


def _scalars(data) -> dict[str, float]:
    merged = data[0] if isinstance(data, list) else data
    out = {}
    for key, value in merged.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--run-dir", default=".cache/areal-smoke", help="logs, checkpoints and steps.jsonl"
    )
    parser.add_argument("--steps", type=int, default=2, help="PPO steps to run")
    parser.add_argument(
        "--setup-timeout", type=float, default=900.0, help="seconds for the vLLM server to start"
    )
    parser.add_argument(
        "--full-logits",
        action="store_true",
        help="AReaL's logits path (logits at every position, logits.selective=false) instead of selective logits",
    )
    parser.add_argument("overrides", nargs="*", help="AReaL config overrides, key=value")
    args = parser.parse_args(argv)

    from areal.api.cli_args import GRPOConfig, load_expr_config
    from datasets import Dataset

    from cua_rl.areal.logits import LogitsConfig, trainer_class
    from cua_rl.cpu.training import enable_cpu_training
    from cua_rl.cpu.warm_start import start_workers_warm
    from cua_rl.testing.cache import ensure_model

    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_model("qwen2-text")
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(
        _CONFIG.format(
            steps=args.steps, model=model, run_dir=run_dir, setup_timeout=args.setup_timeout
        )
    )
    config, _ = load_expr_config(["--config", str(cfg_path), *args.overrides], GRPOConfig)
    for line in enable_cpu_training(config):
        print(f"[smoke] cpu: {line}", flush=True)
    # The workers forked from a zygote, as train.py starts a CPU run's (cua_rl/cpu/warm_start.py).
    start_workers_warm(True, model=str(model))

    steps_file = run_dir / "steps.jsonl"
    steps_file.write_text("")
    n_rows = 2 * config.train_dataset.batch_size * max(1, args.steps)
    train = Dataset.from_list([{"prompt": PROMPTS[i % len(PROMPTS)]} for i in range(n_rows)])
    committed = 0
    t0 = time.monotonic()
    trainer_cls = trainer_class(LogitsConfig(selective=not args.full_logits))
    print(f"[smoke] trainer: {trainer_cls.__name__}", flush=True)
    with trainer_cls(config, train_dataset=train, valid_dataset=None) as trainer:
        print(f"[smoke] trainer ready in {time.monotonic() - t0:.1f}s", flush=True)
        commit = trainer.stats_logger.commit

        def record(epoch, step, global_step, data):
            nonlocal committed
            stats = _scalars(data)
            with steps_file.open("a") as f:
                f.write(json.dumps({"global_step": global_step, **stats}) + "\n")
            shown = {name: stats.get(key, math.nan) for name, key in SUMMARY.items()}
            print(
                f"[smoke] step {global_step}: "
                + " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                flush=True,
            )
            committed += 1
            return commit(epoch, step, global_step, data)

        trainer.stats_logger.commit = record
        t1 = time.monotonic()
        trainer.train(
            workflow=f"{__name__ if __name__ != '__main__' else 'cua_rl.cpu.smoke'}.OneTurnWorkflow",
            workflow_kwargs={"gconfig": config.gconfig, "tokenizer_path": str(model)},
        )
        print(f"[smoke] {committed} steps in {time.monotonic() - t1:.1f}s", flush=True)
    print(f"[smoke] total {time.monotonic() - t0:.1f}s; steps in {steps_file}", flush=True)
    return 0 if committed == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
