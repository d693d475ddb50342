"""``--check``'s GPU step: one real PPO step on this node's first GPU before a cluster is spent.

What only a GPU shows (NCCL refusing a CPU tensor, the attention kernels, bf16, the node's torch
recomputing checkpointed layers) shows here: on a machine with CUDA the check runs
``cua_rl.testing.gpu_step`` in a process of its own on the first visible GPU, with the config's
dtype, ``attn_impl``, vision deduplication, selective logits and gradient checkpointing, on a tiny
random model of ``actor.path``'s family with its word embeddings tied or untied as the
checkpoint's are, and reports one line per missing piece with its fix (flash-attn that does not
import, a step that fails, a recompute whose gradients differ from the forward's). Without CUDA,
or with ``cpu: true``, it says it skipped the step and names what it would have run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from typing import Any

from cua_rl.app.check_result import CheckResult, tool_report

STEP_TIMEOUT_S = 600
# The line ``cua_rl.testing.gpu_step`` prints its result on (run by module name in a process of
# its own: --check does not import the harness it starts).
RESULT_PREFIX = "gpu-step-result "
# The tiny random model the step builds per family (``cua_rl.testing.cache.BUILDERS``, BPE
# tokenizer); a family with none has nothing to step.
TINY_KIND = {
    "qwen2-vl": "qwen2-vl-bpe",
    "qwen2.5-vl": "qwen2.5-vl",
    "qwen3-vl": "qwen3-vl",
    "qwen3-vl-moe": "qwen3-vl-moe",
}


def step_spec(config: Any, family: str, tied: bool = False) -> dict[str, Any]:
    return {
        "family": family,
        "tied": tied,
        "dtype": config.actor.dtype,
        "attn_impl": config.actor.attn_impl,
        "vision": asdict(config.actor.vision),
        "selective": bool(config.logits.selective),
        "gradient_checkpointing": bool(config.actor.gradient_checkpointing),
    }


def describe(spec: dict[str, Any]) -> str:
    vision = spec["vision"]
    parts = [
        f"{'tied' if spec['tied'] else 'untied'} embeddings",
        spec["dtype"],
        f"attn_impl {spec['attn_impl']}",
        f"vision dedup {'on' if vision['dedup'] else 'off'}"
        + (", tower frozen" if vision["freeze"] else ""),
        f"selective logits {'on' if spec['selective'] else 'off'}",
    ]
    if spec["gradient_checkpointing"]:
        parts.append("gradient checkpointing")
    model = spec["family"] or "model of actor.path's family"
    return f"one PPO step of a tiny random {model} ({', '.join(parts)})"


def first_gpu(environ: dict[str, str]) -> str:
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def run_step(spec: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    # --check writes nothing: no bytecode either.
    env = {**environ, "CUDA_VISIBLE_DEVICES": first_gpu(environ), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "cua_rl.testing.gpu_step", json.dumps(spec)]
    report, why = tool_report(cmd, env=env, timeout_s=STEP_TIMEOUT_S, prefix=RESULT_PREFIX)
    return report if report is not None else {"ok": False, "error": why}


def step_lines(spec: dict[str, Any], result: dict[str, Any]) -> list[CheckResult]:
    lines = []
    if result.get("attention_problem"):
        lines.append(
            CheckResult(
                "attention",
                False,
                f"actor.attn_impl={spec['attn_impl']}: {result['attention_problem']}: install "
                "flash-attn in AReaL's environment, or set actor.attn_impl=sdpa (exact: SDPA "
                "once per packed sequence, cua_rl/areal/attention.py)",
            )  # fmt: skip
        )
    if "error" in result:
        lines.append(
            CheckResult(
                "gpu-step",
                False,
                f"{describe(spec)} failed on this node: {result['error']} (the traceback: "
                f"python -m cua_rl.testing.gpu_step '{json.dumps(spec)}')",
            )  # fmt: skip
        )
        return lines
    stats = result.get("stats", {})
    vision = ""
    if "cua_vision/row_images" in stats:
        vision = (
            f", {int(stats['cua_vision/row_images'])} images in rows, "
            f"{int(stats.get('cua_vision/encoded_images', 0))} encoded"
        )
    ran = f" with {result['attn_impl']}" if result.get("attention_problem") else ""
    peak = f", peak {result['peak_gib']} GiB" if result.get("peak_gib") is not None else ""
    detail = (
        f"{describe(spec)}{ran} on {result.get('device')} under {result.get('backend')} in "
        f"{result.get('step_s')} s{peak}{vision}"
    )
    recompute = result.get("recompute")
    if recompute is not None:
        detail += (
            f"; checkpointed gradients within {recompute['max_rel']:.1e} of the forward's "
            f"(tolerance {recompute['tolerance']:.1e})"
        )
    if not result.get("loss_finite", False):
        lines.append(CheckResult("gpu-step", False, f"{detail}: the loss is not finite"))
    elif recompute is not None and not recompute["ok"]:
        lines.append(
            CheckResult(
                "gpu-step",
                False,
                f"{detail}: gradient checkpointing recomputes something the forward did not "
                f"(largest difference in {recompute['worst']}); set "
                "actor.gradient_checkpointing=false and report this with the node's torch "
                f"version ({result.get('torch')})",
            )
        )
    elif spec["selective"] and not result.get("selective"):
        lines.append(CheckResult("gpu-step", False, f"{detail}: selective logits fell back"))
    else:
        lines.append(CheckResult("gpu-step", True, detail))
    return lines


def gpu_check(
    config: Any, *, cuda: bool, environ: dict[str, str] | None = None
) -> list[CheckResult]:
    from cua_rl.app.family import detect_family

    environ = dict(os.environ) if environ is None else environ
    try:
        family = detect_family(config.actor.path) if config.actor.path else None
    except Exception:
        family = None  # the family line says why
    name = family.name if family is not None else ""
    spec = step_spec(config, name, family.tied_embeddings if family is not None else False)
    if config.cpu:
        return [CheckResult.skip("gpu-step", "cpu=true trains on the CPU harness")]
    if not cuda:
        return [
            CheckResult.skip(
                "gpu-step",
                f"no CUDA on this machine; on a GPU node --check runs {describe(spec)} on the "
                "first GPU under NCCL",
            )
        ]
    if name not in TINY_KIND:
        why = f"the family {name!r} has no tiny model" if name else "actor.path has no config.json"
        return [CheckResult("gpu-step", False, f"{why}: nothing to step ({describe(spec)})")]
    return step_lines(spec, run_step(spec, environ))
