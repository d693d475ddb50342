"""vLLM worker extension that reloads weights from a checkpoint folder (AReaL's disk mode).

AReaL's own extension (``areal.engine.vllm_ext.vllm_worker_extension``) imports AReaL's
distributed and platform modules, which pull AReaL's whole import graph (hydra, omegaconf,
ray, flask, ...) into the vLLM interpreter. Disk weight update needs none of that: the
trainer saves a HuggingFace checkpoint and the server asks each worker to load it in place.
Only ``areal_update_weights`` is provided; the NCCL (xccl) and LoRA methods are not, so
``actor.weight_update_mode`` must be ``disk``.

Loaded by vLLM inside its engine-core process via ``--worker-extension-cls``. Each reload
allocates the whole model anew and frees the old one: the worker holds glibc's mmap threshold
and gives free pages back after each reload (``cua_rl.heap``), or its RSS creeps step by step.
"""

from __future__ import annotations

from pathlib import Path

from cua_rl.heap import hold_mmap_threshold, release_free_memory
from cua_rl.logs import get_logger

log = get_logger(__name__)
hold_mmap_threshold()


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` cannot be loaded as a local HF checkpoint, or ``None`` if it looks loadable.

    Checked before touching the model: vLLM's reload first turns the layers back into
    placeholder (meta) tensors, so a load that fails half way leaves a model whose next forward
    kills the engine core (measured: ``_C::onednn_mm ... Meta tensors`` -> EngineDeadError). A
    missing folder would also be taken for a hub repo id and looked up on the network.
    """
    folder = Path(path)
    if not folder.is_absolute():
        return f"checkpoint path {path!r} is not absolute"
    if not folder.is_dir():
        return f"checkpoint folder {path} does not exist"
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        return f"checkpoint folder {path} holds no *.safetensors or *.bin weights"
    return None


def experts_in_released_layout(path: str) -> int:
    """Rewrite fused MoE expert tensors of a trainer-saved checkpoint in the released layout;
    returns how many were transposed.

    transformers 5 keeps (and saves) a layer's fused experts as ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``; released checkpoints, and vLLM's loader, have them as ``[E, H, 2I]``
    and ``[E, I, H]`` (transformers transposes them on load). The layout is told from the
    config's hidden size H and expert width I, not from the family's name; when H equals I or
    2I the shapes cannot tell and nothing is changed.
    """
    import json

    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") or config
    hidden, inter = text.get("hidden_size"), text.get("moe_intermediate_size")
    if not hidden or not inter or hidden in (inter, 2 * inter):
        return 0
    saved = {
        "mlp.experts.gate_up_proj": (2 * inter, hidden),
        "mlp.experts.down_proj": (hidden, inter),
    }
    from safetensors import safe_open
    from safetensors.torch import save_file

    changed = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            keys = [
                k for k in f.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
                if any(k.endswith(s) and tuple(f.get_slice(k).get_shape()[1:]) == shape
                       for s, shape in saved.items())
            ]  # fmt: skip
            if not keys:
                continue
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        for k in keys:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, str(file), metadata=meta)
        changed += len(keys)
    return changed


class DiskWeightReloadExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` its runner)."""

    def areal_update_weights(self, model_path: str) -> tuple[bool, str]:
        problem = checkpoint_problem(model_path)
        if problem:
            return False, problem
        try:
            experts_in_released_layout(model_path)
            # vLLM 0.32's own in-place reload (Worker.reload_weights ->
            # model_loader/reload/inplace.py). AReaL's extension instead calls
            # model_loader.load_weights on the live model, which fails on the CPU build:
            # process_weights_after_loading has repacked the linear layers into kernel format
            # and left the original parameters empty ("Attempted to load weight
            # (torch.Size([128, 256])) into parameter (torch.Size([0]))"). reload_weights
            # restores checkpoint-format parameters, loads, then repacks.
            self.reload_weights(weights_path=model_path, is_checkpoint_format=True)
            release_free_memory()
        except Exception as exc:  # the message travels back to the trainer as a 400
            log.exception("weight reload from %s failed", model_path)
            return False, (
                f"weight reload from {model_path} failed: {exc!r}; the model may be half-loaded, "
                "restart the inference server"
            )
        return True, f"loaded {model_path}"
