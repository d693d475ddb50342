"""Tiny random models of the production families: Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE.

Each is shaped like its released checkpoints where this project is careful, and tiny everywhere
else (two text layers of hidden size 128 and head_dim 64, which vLLM's CPU attention needs; two
vision blocks): the vision tower's patch size (14 for Qwen2.5-VL, 16 for Qwen3-VL), Qwen2.5-VL's
windowed attention with one full-attention block, Qwen3-VL's DeepStack (vision block 1 feeds the
decoder's first layer) and its interleaved multimodal rotary sections, the MoE's routed experts,
the processor's normalisation constants, and the family's own chat template
(:mod:`cua_rl.testing.templates`). The tokenizer is the byte-level BPE of
:mod:`cua_rl.testing.models` (merges, as production tokenizers have).

Pixel budgets are small (4 to 32 merged tokens per image) so CPU tests stay fast; the production
budgets are in configs/cua.yaml and docs/families.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from cua_rl.testing.models import (
    VISION_TOKEN_IDS,
    _build_tokenizer,
    _save_generation_config,
    _seeded_init,
    _text_config,
    _wrap_tokenizer,
    processor_kwargs,
)
from cua_rl.testing.templates import TEMPLATES

# Processor normalisation: Qwen2-VL/2.5-VL use CLIP's constants, Qwen3-VL 0.5 everywhere.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    processor_class: str
    video_processor_class: str
    template: str
    patch_size: int
    image_mean: list[float]
    image_std: list[float]
    rope: dict
    vision: dict
    text_extra: dict = field(default_factory=dict)
    # Fused expert tensors the released checkpoints store as [experts, in, out] while
    # transformers 5 keeps (and saves) them as [experts, out, in]; vLLM reads the released layout
    # and transformers transposes them back on load.
    transposed_on_disk: tuple[str, ...] = ()

    @property
    def factor(self) -> int:
        """Pixels per merged image token along one side (patch x merge size 2)."""
        return self.patch_size * 2


_VISION = dict(
    depth=2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=2,
    out_hidden_size=128,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
# Qwen3-VL: learned position embeddings over a 16x16 patch grid (interpolated to the image's
# grid) and DeepStack from the last vision block.
_QWEN3_VISION = dict(
    _VISION, patch_size=16, num_position_embeddings=256, deepstack_visual_indexes=[1]
)
# Interleaved M-RoPE: sections of head_dim / 2 = 32 (temporal, height, width).
_QWEN3_ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [12, 10, 10],
    "mrope_interleaved": True,
}

FAMILIES = {
    "qwen2.5-vl": Family(
        config_class="Qwen2_5_VLConfig",
        model_class="Qwen2_5_VLForConditionalGeneration",
        processor_class="Qwen2_5_VLProcessor",
        video_processor_class="Qwen2VLVideoProcessor",
        template=TEMPLATES["qwen2.5-vl"],
        patch_size=14,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        rope={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        # Windowed attention (112-pixel windows) in block 0, full attention in block 1.
        vision=dict(_VISION, patch_size=14, window_size=112, fullatt_block_indexes=[1]),
    ),
    "qwen3-vl": Family(
        config_class="Qwen3VLConfig",
        model_class="Qwen3VLForConditionalGeneration",
        processor_class="Qwen3VLProcessor",
        video_processor_class="Qwen3VLVideoProcessor",
        template=TEMPLATES["qwen3-vl"],
        patch_size=16,
        image_mean=HALF,
        image_std=HALF,
        rope=_QWEN3_ROPE,
        vision=_QWEN3_VISION,
        text_extra=dict(head_dim=64),
    ),
}

# The MoE: Qwen3-VL with four routed experts, two per token, in every decoder layer.
FAMILIES["qwen3-vl-moe"] = replace(
    FAMILIES["qwen3-vl"],
    config_class="Qwen3VLMoeConfig",
    model_class="Qwen3VLMoeForConditionalGeneration",
    text_extra=dict(
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        # Not the hidden size: a square expert matrix would hide a transposition.
        moe_intermediate_size=96,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    transposed_on_disk=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)


def build_tiny_vl_family(
    dst: str | os.PathLike, family: str, *, seed: int = 0, tied: bool = False
) -> Path:
    """Write a tiny random model of ``family`` (a key of ``FAMILIES``) into ``dst``; ``tied``:
    the output layer shares the input embedding (Qwen3-VL-2B ties them, the 8B does not)."""
    import torch
    import transformers

    spec = FAMILIES[family]
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tok = _wrap_tokenizer(_build_tokenizer("bpe"), spec.template)
    text = {
        **_text_config(len(tok), tied=tied),
        **spec.text_extra,
        "rope_parameters": dict(spec.rope),
    }
    config = getattr(transformers, spec.config_class)(
        text_config=text,
        vision_config=dict(spec.vision),
        **VISION_TOKEN_IDS,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).to(torch.float32)
    _seeded_init(model, seed)
    model.save_pretrained(dst, safe_serialization=True)
    if spec.transposed_on_disk:
        _transpose_on_disk(dst / "model.safetensors", spec.transposed_on_disk)
    _save_generation_config(dst)

    # 4 to 32 merged tokens per image: a 360x640 screenshot stays at a few dozen tokens.
    unit = spec.factor * spec.factor
    common = processor_kwargs(
        spec.patch_size, unit * 4, unit * 32, image_mean=spec.image_mean, image_std=spec.image_std
    )
    processor = getattr(transformers, spec.processor_class)(
        image_processor=transformers.Qwen2VLImageProcessor(**common),
        tokenizer=tok,
        video_processor=getattr(transformers, spec.video_processor_class)(**common),
        chat_template=spec.template,
    )
    processor.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


def _transpose_on_disk(path: Path, suffixes: tuple[str, ...]) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    for key, value in tensors.items():
        if key.endswith(suffixes):
            tensors[key] = value.transpose(1, 2).contiguous()
    save_file(dict(sorted(tensors.items())), str(path), metadata=meta)
