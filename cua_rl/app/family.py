"""The policy checkpoint's model family, read from its own files, and what the config must fit.

The family decides what a screenshot costs: its vision tower's patch size (14 pixels for Qwen2-VL
and Qwen2.5-VL, 16 for Qwen3-VL) times the merge size gives the pixels per image token, and the
processor's pixel budget (``max_pixels``, or ``size.longest_edge`` in newer processor files)
bounds the tokens of one screenshot. An episode keeps every screenshot in its prompt, so the
last prompt of a full episode holds up to ``images x tokens per image`` image tokens, which
must fit in ``vllm.max_model_len``, which must fit in the checkpoint's context. These checks
run before the trainer starts, and ``--check`` prints the family it found.

Detection reads ``config.json`` (``model_type``, the vision config's patch and merge sizes and
whether it has DeepStack layers) rather than trusting a name.

The same numbers size vLLM's KV cache: a token keeps a key and a value per layer and KV head
(``2 x layers x KV heads x head size x bytes``), vLLM allocates whole blocks of ``block_size``
tokens (one of them held back), and a server starts only if its cache holds one request of
``max_model_len``. When ``vllm.kv_cache_memory_bytes`` fixes the size (the CPU harness sets it),
vLLM's own error for a cache too small advises ``gpu_memory_utilization``, which no longer
matters; this check names the size that fits instead, and the harness sizes its own to fit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cua_rl.app.config_checks import FieldError
from cua_rl.errors import ConfigError

# model_type -> the family name used in docs and configs/cua.yaml.
FAMILY_NAMES = {
    "qwen2_vl": "qwen2-vl",
    "qwen2_5_vl": "qwen2.5-vl",
    "qwen3_vl": "qwen3-vl",
    "qwen3_vl_moe": "qwen3-vl-moe",
}
# Bytes of one cached key or value element, by vLLM's dtype names (kv_cache_dtype "auto" is the
# model's dtype; "auto" as the model's dtype depends on vLLM's platform: not checked).
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
# Text tokens of one turn besides its screenshot: the agent's instruction and history line, the
# template's frame and the reply (max_new_tokens is added on top).
TURN_TEXT_TOKENS = 200


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_type: str
    patch_size: int
    merge_size: int
    deepstack: bool
    context: int  # the text model's max_position_embeddings
    min_pixels: int | None
    max_pixels: int | None
    # The output layer shares the input embedding (Qwen3-VL-2B) or not (Qwen3-VL-8B, MAI-UI-8B):
    # AReaL makes every embedding an FSDP unit of its own when they are untied.
    tied_embeddings: bool = False
    # The text model's attention, which sizes the KV cache (0: not in its config.json).
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    def kv_bytes_per_token(
        self, dtype: str, kv_cache_dtype: str = "auto", tp: int = 1, pp: int = 1
    ):
        """KV cache bytes one token takes on one GPU of a server with tensor parallelism
        ``tp`` and pipeline parallelism ``pp`` (KV heads are split, or copied when fewer than
        ``tp``; layers are split); None when a dtype or a number is unknown."""
        size = DTYPE_BYTES.get(dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
        if not (size and self.layers and self.kv_heads and self.head_dim):
            return None
        heads = max(1, self.kv_heads // max(tp, 1))
        return 2 * math.ceil(self.layers / max(pp, 1)) * heads * self.head_dim * size

    @property
    def pixels_per_token(self) -> int:
        side = self.patch_size * self.merge_size
        return side * side

    @property
    def max_image_tokens(self) -> int | None:
        return None if self.max_pixels is None else self.max_pixels // self.pixels_per_token

    def describe(self) -> str:
        budget = (
            f"up to {self.max_image_tokens} tokens per image (max_pixels {self.max_pixels})"
            if self.max_pixels
            else "no processor pixel budget found"
        )
        vision = f"{self.patch_size}-pixel patches, merge {self.merge_size}"
        if self.deepstack:
            vision += ", DeepStack"
        return (
            f"{self.name} (model_type {self.model_type}): {vision}, context {self.context}, "
            f"{budget}"
        )


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from exc


def _pixel_budget(folder: Path) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) of the checkpoint's image processor, whichever file holds it."""
    pre = _read(folder / "preprocessor_config.json")
    if not pre:
        pre = _read(folder / "processor_config.json").get("image_processor", {})
    size = pre.get("size") or {}
    lo = pre.get("min_pixels") or size.get("shortest_edge")
    hi = pre.get("max_pixels") or size.get("longest_edge")
    return (int(lo) if lo else None, int(hi) if hi else None)


def detect_family(model_dir: str | Path) -> ModelFamily | None:
    """The family of the checkpoint in ``model_dir``; None when it has no config.json."""
    folder = Path(model_dir)
    cfg = _read(folder / "config.json")
    if not cfg:
        return None
    model_type = str(cfg.get("model_type", ""))
    vision = cfg.get("vision_config") or {}
    text = cfg.get("text_config") or cfg
    if not vision:
        raise ConfigError(
            f"{folder}: model_type {model_type!r} has no vision_config; the policy must be a "
            f"vision-language model ({', '.join(sorted(FAMILY_NAMES.values()))})"
        )
    lo, hi = _pixel_budget(folder)
    heads = int(text.get("num_attention_heads") or 0)
    head_dim = text.get("head_dim") or (int(text.get("hidden_size", 0)) // heads if heads else 0)
    return ModelFamily(
        name=FAMILY_NAMES.get(model_type, model_type),
        model_type=model_type,
        patch_size=int(vision.get("patch_size", 14)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        deepstack=bool(vision.get("deepstack_visual_indexes")),
        context=int(text.get("max_position_embeddings", 0)),
        min_pixels=lo,
        max_pixels=hi,
        # transformers' default for every family here is untied.
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layers=int(text.get("num_hidden_layers") or 0),
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(head_dim or 0),
    )


def family_problems(family: ModelFamily, config) -> list[str]:
    """What the config must change to fit this family; each entry says what to set."""
    return [str(p) for p in family_field_problems(family, config)]


def family_field_problems(family: ModelFamily, config) -> list[FieldError]:
    """``family_problems``, each with the key to change (the loader says where it was set).
    Reads the config by attribute only, so the merged config is enough (config_load.py)."""
    problems: list[FieldError] = []

    def add(key: str, message: str) -> None:
        problems.append(FieldError(key, message))

    if family.model_type not in FAMILY_NAMES:
        add(
            "actor.path",
            f"model_type {family.model_type!r} is not a family this project trains and tests "
            f"({', '.join(sorted(FAMILY_NAMES))}); use a Qwen2-VL, Qwen2.5-VL or Qwen3-VL "
            "checkpoint",
        )
    max_len = int(config.vllm.max_model_len or 0)
    if family.context and max_len > family.context:
        add(
            "vllm.max_model_len",
            f"vllm.max_model_len={max_len} exceeds the checkpoint's context "
            f"({family.context} positions): set vllm.max_model_len={family.context} or less",
        )
    limit = _image_limit(config.vllm.limit_mm_per_prompt)
    images = min(config.agent.max_steps, limit) if limit else config.agent.max_steps
    if config.trajectory.max_images < images:
        add(
            "trajectory.max_images",
            f"trajectory.max_images={config.trajectory.max_images} is below the "
            f"{images} screenshots a full episode carries: set trajectory.max_images={images}",
        )
    per_image = family.max_image_tokens
    if per_image and max_len:
        need = images * (per_image + TURN_TEXT_TOKENS + config.gconfig.max_new_tokens)
        if need > max_len:
            fit = max_len // images - TURN_TEXT_TOKENS - config.gconfig.max_new_tokens
            hint = (
                f"set the checkpoint's image processor max_pixels to at most "
                f"{max(fit, 1) * family.pixels_per_token} ({max(fit, 1)} tokens per screenshot)"
                if fit > 0
                else "lower agent.max_steps"
            )
            add(
                "vllm.max_model_len",
                f"a full episode of {images} screenshots at up to {per_image} tokens each needs "
                f"about {need} tokens, more than vllm.max_model_len={max_len}: {hint}, or raise "
                "vllm.max_model_len (docs/families.md gives each family's budgets)",
            )
    kv_bytes = getattr(config.vllm, "kv_cache_memory_bytes", None)
    need = kv_request_bytes(family, config)
    if kv_bytes and need and kv_bytes < need:
        add(
            "vllm.kv_cache_memory_bytes",
            f"vllm.kv_cache_memory_bytes={kv_bytes} holds fewer than the {need} bytes one "
            f"request of vllm.max_model_len={max_len} takes in {family.name}'s KV cache, and "
            f"vLLM does not start: set vllm.kv_cache_memory_bytes={need} or more, or lower "
            "vllm.max_model_len",
        )
    return problems


def kv_request_bytes(family: ModelFamily, config) -> int | None:
    """Bytes of KV cache one request of ``vllm.max_model_len`` tokens takes on one GPU of a
    rollout server (whole blocks); None when the family or the config leaves it unknown."""
    from areal.api.alloc_mode import ModelAllocation

    vllm = config.vllm
    max_len = int(vllm.max_model_len or family.context or 0)
    try:
        parallel = ModelAllocation.from_str(config.rollout.backend, name="rollout").parallel
        tp, pp = parallel.tp_size, parallel.pp_size
    except Exception:  # an allocation the table refuses (reported there)
        return None
    per_token = family.kv_bytes_per_token(
        str(vllm.dtype), str(getattr(vllm, "kv_cache_dtype", "auto")), tp, pp
    )
    block = int(vllm.block_size or 0)
    if not (per_token and max_len and block > 0):
        return None
    # vLLM keeps one block of the pool back (its null block) before it checks.
    return (math.ceil(max_len / block) + 1) * block * per_token


def _image_limit(limit_mm: str) -> int | None:
    if not limit_mm:
        return None
    value = json.loads(limit_mm).get("image")
    return int(value) if value is not None else None


def check_family(config) -> ModelFamily | None:
    """Detect the policy's family and refuse a config that cannot fit it (ConfigError)."""
    family = detect_family(config.actor.path) if config.actor.path else None
    if family is None:
        return None
    problems = family_problems(family, config)
    if problems:
        raise ConfigError(f"{family.name} checkpoint {config.actor.path}: " + "; ".join(problems))
    return family
