"""One PPO step of a tiny random model of the policy's family, as the training's actor runs it.

``--check`` on a machine with CUDA runs this module in a process of its own on the first GPU
(``cua_rl.app.check_gpu``): a tiny random model of ``actor.path``'s family is built in a
temporary folder, its word embeddings tied or not as the checkpoint's are (AReaL wraps the two
into different FSDP units), the production actor (``SelectiveLogitsPPOActor`` or
``CuaPPOActor``, as ``logits.selective`` says) is created as an AReaL worker creates it, with the
configured dtype, ``attn_impl``, vision settings and gradient checkpointing, in a one-process
group of the platform's backend (NCCL on a GPU), and it takes one step on two episodes of
MAI-UI-style rows: ``compute_logp``, ``compute_advantages``, ``ppo_update``, each followed by
``export_stats``, which all-reduces every statistic over that group (NCCL refuses CPU tensors;
gloo, the only backend of a CPU run, does not). With gradient checkpointing the same update then
runs with and without it (``cua_rl.testing.recompute_check``): the gradients must agree, or the
recompute computes something the forward did not. With ``attn_impl: flash_attention_2`` and no
flash-attn the step runs with ``sdpa`` and the result says what is missing. Nothing is written
outside the temporary folder. ``CUA_RL_OLD_RECOMPUTE=1`` runs it under torch <= 2.12's recompute
(``cua_rl.testing.old_recompute``): the CPU suite's way of stepping as a GPU node's torch does.

    python -m cua_rl.testing.gpu_step '{"family": "qwen3-vl", "dtype": "bfloat16", ...}'

prints one line ``gpu-step-result {json}`` last (``STEP_KEYS`` for the keys of the spec). On a
machine without CUDA it runs on the CPU with gloo: the tests drive it so.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from typing import Any

# The result line's prefix and the tiny model per family are --check's (it reads the one and
# asks the other before it starts this module by name): the product never imports the harness.
from cua_rl.app.check_gpu import RESULT_PREFIX, TINY_KIND

# The spec: what --check takes from the config.
STEP_KEYS = (
    "family",
    "tied",
    "dtype",
    "attn_impl",
    "vision",
    "selective",
    "gradient_checkpointing",
)
OLD_RECOMPUTE_ENV = "CUA_RL_OLD_RECOMPUTE"


def attention_problem(attn_impl: str) -> str:
    """Why ``attn_impl`` cannot run in this environment, or ""."""
    if not attn_impl.startswith("flash_attention"):
        return ""
    module = "flash_attn_interface" if attn_impl == "flash_attention_3" else "flash_attn"
    try:
        __import__(module)
    except ImportError as exc:
        return f"{attn_impl} needs the {module} module, which does not import ({exc})"
    return ""


def _rows(actor, model_dir) -> list[dict[str, Any]]:
    from cua_rl.testing.actor import group_rows, vision_geometry

    vocab = actor.model.get_output_embeddings().weight.shape[0]
    patch_dim, merge = vision_geometry(model_dir)
    # Two episodes (a GRPO group of 2) of 4 calls with a 3-screenshot window: 18 images in the
    # rows, 8 distinct.
    return group_rows(4, window=3, vocab_size=vocab, patch_dim=patch_dim, merge=merge)


def _step(actor, rows) -> tuple[dict[str, float], list[dict]]:
    """One PPO step's statistics, and the batch its update trained (for the recompute check)."""
    import copy

    from cua_rl.testing.actor import delivered

    logps = actor.compute_logp(delivered(rows))
    for row, lp in zip(rows, logps, strict=True):
        row["prox_logp"] = lp
    stats = actor.export_stats()
    batch = actor.compute_advantages(delivered(rows))
    stats.update(actor.export_stats())
    actor.ppo_update(delivered(copy.deepcopy(batch)))
    stats.update(actor.export_stats())
    return stats, batch


def _recomputed(actor, batch, cuda: bool) -> dict[str, Any]:
    from cua_rl.testing.recompute_check import CPU_TOLERANCE, GPU_TOLERANCE, recompute_check

    check = recompute_check(actor, batch)
    check["tolerance"] = GPU_TOLERANCE if cuda else CPU_TOLERANCE
    check["ok"] = check["max_rel"] <= check["tolerance"]
    return check


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import contextlib
    import os

    import torch
    import torch.distributed as dist
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.areal.vision import VisionSection
    from cua_rl.testing.actor import actor_config, make_actor
    from cua_rl.testing.cache import BUILDERS, TIED
    from cua_rl.testing.old_recompute import old_fsdp_recompute

    cuda = torch.cuda.is_available()
    old = os.environ.get(OLD_RECOMPUTE_ENV) == "1"
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "attention_problem": attention_problem(spec["attn_impl"]),
        "torch": torch.__version__,
        "old_recompute": old,
    }
    attn_impl = "sdpa" if result["attention_problem"] else spec["attn_impl"]
    result["attn_impl"] = attn_impl
    with tempfile.TemporaryDirectory(prefix="cua-gpu-step-") as tmp:
        t0 = time.perf_counter()
        BUILDERS[TINY_KIND[spec["family"]] + (TIED if spec["tied"] else "")](tmp, 0)
        config = actor_config(
            tmp,
            dtype=spec["dtype"],
            attn_impl=attn_impl,
            gradient_checkpointing=spec["gradient_checkpointing"],
            vision=VisionSection(**spec["vision"]),
            optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=1 << 16),
        )
        cls = SelectiveLogitsPPOActor if spec["selective"] else CuaPPOActor
        actor = make_actor(cls, config)
        try:
            result["backend"] = str(dist.get_backend())
            rows = _rows(actor, tmp)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            with old_fsdp_recompute() if old else contextlib.nullcontext():
                stats, batch = _step(actor, rows)
                result["step_s"] = round(time.perf_counter() - started, 2)
                result["setup_s"] = round(started - t0, 2)
                result["peak_gib"] = (
                    round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
                )
                if spec["gradient_checkpointing"]:
                    result["recompute"] = _recomputed(actor, batch, cuda)
        finally:
            actor.destroy()
            if dist.is_initialized():
                dist.destroy_process_group()
    result["stats"] = {k: v for k, v in stats.items() if _reported(k)}
    result["loss_finite"] = all(
        v == v and abs(v) != float("inf") for k, v in stats.items() if "loss" in k
    )
    result["selective"] = bool(spec["selective"]) and actor._fallback == ""
    result["ok"] = result["loss_finite"] and result.get("recompute", {}).get("ok", True)
    return result


def _reported(key: str) -> bool:
    return key.startswith("cua_vision/") or key in (
        "ppo_actor/update/actor_loss/avg",
        "ppo_actor/update/grad_norm",
        "ppo_actor/update/num_micro_batches",
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    missing = [k for k in STEP_KEYS if k not in spec]
    if missing:
        print(f"gpu_step: the spec lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        result = run(spec)
    except Exception as exc:  # the check reports it as one line; the traceback goes to stderr
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
