"""cua-rl's actor against AReaL's on a GPU, on the project's row layouts; and the GPU smoke step.

Per actor and context policy, one PPO step (``compute_logp`` then ``ppo_update``, wall seconds
with CUDA synchronised, after an untimed warm-up step of the same rows) of 2 episodes (a GRPO
group of 2) of ``--turns`` turns, a randomly initialised model of Qwen2-VL-2B's shape, bf16 compute with fp32
master weights and Adam, gradient checkpointing, ``attn_impl: sdpa`` (cua-rl's per-sequence SDPA,
``cua_rl.areal.attention``), each turn a ~1 MP phone screenshot (36 x 36 merged tokens):

  full      the append-only conversation: one row per episode
  window-3  MAI-UI's context: one row per call, the last 3 screenshots, older steps as text
  current   one row per call, the current screenshot only
  window-5  MAI-UI's context with 5 screenshots

Actors: ``areal`` is AReaL's ``FSDPPPOActor``; ``cua`` is the one configs/cua.yaml builds
(``SelectiveLogitsPPOActor``: each distinct screenshot through the vision tower once per
micro-batch, an episode's rows packed in turn order, logits only at loss positions);
``cua-no-dedup``, ``cua-no-selective`` and ``cua-plain`` take its parts away one at a time
(``ACTORS``), to say which part a difference in time comes from. Printed per
run: rows, tokens, images in rows and encoded, micro-batches, compute_logp and ppo_update
seconds, peak GPU memory; then each layout's step time against the same actor's full row, and
cua's against AReaL's. Every statistic goes through ``export_stats``'s real all-reduce: a CPU
tensor reaching NCCL fails the step, and the bench names each statistic made on the CPU.

``--smoke`` first runs ``--check``'s GPU step (``cua_rl.testing.gpu_step``) for each tiny
family (Qwen3-VL first, untied and tied, then with AReaL's vision path; then Qwen2-VL,
Qwen2.5-VL and Qwen3-VL-MoE), bf16 with gradient checkpointing, each with its recompute check
(the same update with and without checkpointing, gradients compared), and prints its check
lines.

On a lent GPU machine with PyTorch and CUDA but nothing else (docs/gpu.md has the recipe: AReaL
1.0.4 and its light imports carried as py3.12 wheels; Ray and the trackers, which the actor never
calls, replaced by stand-ins when they are not installed):

    python bench/gpu_actor.py --smoke --turns 30 --budget-s 420

``--small`` runs the same on this machine's CPU with tiny sizes, to check the script. Results
go to ``$OUT`` (or ``runs/gpu-actor``): ``gpu_actor.txt`` and ``gpu_actor.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu-actor")
T0 = time.time()
RESULTS: list[dict] = []
LAYOUTS = {"full": None, "window-3": 3, "current": 1, "window-5": 5}
# --actors: the actor class and actor.vision.dedup. ``cua`` is configs/cua.yaml's; the three
# between it and AReaL's take one of its parts away at a time, to place a difference in time.
ACTORS = {
    "cua": ("selective", True),
    "cua-no-dedup": ("selective", False),  # selective logits, every image through the tower
    "cua-no-selective": ("cua", True),  # logits.selective=false: CuaPPOActor, dedup on
    "cua-plain": ("cua", False),  # CuaPPOActor with dedup off: AReaL's path with the fixes
    "areal": ("areal", True),  # AReaL's FSDPPPOActor (reads no actor.vision)
}
# Imported at module level by AReaL but never called by the actor; stand-ins where missing.
STUBBED = ("ray", "wandb", "swanlab", "trackio", "tensorboardX", "gradio_client", "pyecharts")


def _stand_in(name: str) -> type:
    """A class whose every attribute, instance or call is another stand-in (``ray.actor.X``)."""
    return _AnyType(name, (), {"__init__": lambda self, *a, **k: None,
                               "__call__": lambda self, *a, **k: _stand_in(name)(),
                               "__getattr__": lambda self, attr: _stand_in(attr)})  # fmt: skip


class _AnyType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(name)


class _Anything(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in(name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-ins for ``STUBBED`` packages this interpreter lacks."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top not in STUBBED:
            return None
        for finder in sys.meta_path:
            if finder is not self and _finds(finder, top):
                return None  # the real package is installed
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Anything(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _finds(finder, name: str) -> bool:
    try:
        return finder.find_spec(name, None) is not None
    except Exception:
        return False


def log(*parts) -> None:
    print(f"[{time.time() - T0:7.1f}s]", *parts, flush=True)


def dump() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_actor.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def model_dir(small: bool) -> str:
    """A folder with the tiny wide model's tokenizer and processor, and the 2B shape's config."""
    from cua_rl.testing.cache import ensure_model

    src = Path(os.environ.get("BENCH_MODEL_FILES") or ensure_model("qwen2-vl-wide"))
    dst = Path(tempfile.mkdtemp(prefix="cua-gpu-actor-model-"))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg["text_config"]
    if small:
        text.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
        text.update(num_attention_heads=4, num_key_value_heads=2)
        text.update(layer_types=["full_attention"] * 2)
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
        cfg["vision_config"].update(depth=2, embed_dim=64, hidden_size=128, num_heads=2)
    else:  # Qwen2-VL-2B
        text.update(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
        text.update(num_attention_heads=12, num_key_value_heads=2, max_window_layers=28)
        text.update(layer_types=["full_attention"] * 28)
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
        cfg["vision_config"].update(
            depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16
        )
    text.update(tie_word_embeddings=True, rope_parameters=rope)
    cfg["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(dst)


def random_init_instead_of_loading() -> None:
    """AReaL loads a VLM with from_pretrained; a random 2B model has no weights file (writing
    4 GB to disk and reading it back would only cost the lease time)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    def from_pretrained(pretrained_model_name_or_path=None, *args, **kwargs):
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path)
        kwargs.pop("trust_remote_code", None)
        torch.manual_seed(0)
        return AutoModelForImageTextToText.from_config(config, **kwargs)

    AutoModelForImageTextToText.from_pretrained = from_pretrained


def rows_for(layout: str, turns: int, vocab: int, image_tokens: int, small: bool) -> list[dict]:
    from cua_rl.testing.actor import group_rows

    sizes = (
        dict(prompt_tokens=40, step_tokens=20, sampled_tokens=30)
        if small
        else dict(prompt_tokens=630, step_tokens=60, sampled_tokens=40)
    )
    return group_rows(
        turns, window=LAYOUTS[layout], vocab_size=vocab, image_tokens=image_tokens, **sizes
    )


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_step(actor, rows, counter) -> tuple[float, float, float, int, int]:
    """(compute_logp s, ppo_update s, peak GiB, images encoded in ppo_update, micro-batches)."""
    import torch

    from cua_rl.testing.actor import delivered

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch = copy.deepcopy(rows)
    sync()
    t = time.perf_counter()
    logps = actor.compute_logp(delivered(batch))
    sync()
    logp_s = time.perf_counter() - t
    for row, lp in zip(batch, logps, strict=True):
        row["prox_logp"] = lp
    actor.export_stats()
    # Each row keeps its own images through the advantages (AReaL's copies every row's images
    # into every row): the same for both actors.
    media = [row.pop("multi_modal_input") for row in batch]
    batch = actor.compute_advantages(delivered(batch))
    for row, own in zip(batch, media, strict=True):
        row["multi_modal_input"] = own
    actor.export_stats()
    counter["images"] = 0
    sync()
    t = time.perf_counter()
    actor.ppo_update(delivered(batch))
    sync()
    update_s = time.perf_counter() - t
    stats = actor.export_stats()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    mbs = int(stats.get("ppo_actor/update/num_micro_batches", 0))
    return logp_s, update_s, peak, counter["images"], mbs


def bench_actor(name: str, cls: type, config, args) -> None:
    import torch

    from cua_rl.areal.vision_dedup import vision_tower
    from cua_rl.testing.actor import make_actor

    log(f"actor {name}: {cls.__name__}")
    actor = make_actor(cls, config)
    counter = {"images": 0}

    def count(module, a, kw, output):
        counter["images"] += int(kw["grid_thw"].shape[0])

    vision_tower(actor.model).register_forward_hook(count, with_kwargs=True)
    vocab = actor.model.get_output_embeddings().weight.shape[0]
    params = sum(p.numel() for p in actor.model.parameters()) / 1e9
    log(f"  model ready: {params:.2f}B parameters (local shard), vocabulary {vocab}")
    for turns in args.turns:
        for layout in args.layouts:
            if time.time() - T0 > args.budget_s:
                log(f"  budget reached: {name} {layout} {turns} skipped")
                RESULTS.append(dict(actor=name, layout=layout, turns=turns, error="skipped"))
                continue
            RESULTS.append(measure(actor, name, layout, turns, vocab, counter, args))
            dump()
            log("  ", json.dumps(RESULTS[-1]))
            gc.collect()
    actor.destroy()
    del actor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(actor, name, layout, turns, vocab, counter, args) -> dict:
    import torch

    rows = rows_for(layout, turns, vocab, args.image_tokens, args.small)
    # Warm-up at the measured size, untimed. A warm-up of 3 turns was not enough: on an H200
    # (2026-11-28) the first 30-turn step of a process took 1.3-1.7x the time of the same
    # actor's later ones, whichever actor came first (CUDA's caching allocator growing to the
    # step's size), which made the order of --actors look like a difference between actors.
    try:
        run_step(actor, rows, counter)
    except Exception as exc:  # the timed step below reports it
        log(f"  warm-up of {name} {layout} {turns} failed: {type(exc).__name__}")
    gc.collect()
    rec = dict(
        actor=name,
        layout=layout,
        turns=turns,
        rows=len(rows),
        tokens=sum(r["input_ids"].shape[1] for r in rows),
        row_images=sum(int(r["multi_modal_input"][0]["image_grid_thw"].shape[0]) for r in rows),
    )
    try:
        logp_s, update_s, peak, encoded, mbs = run_step(actor, rows, counter)
        rec.update(logp_s=round(logp_s, 2), update_s=round(update_s, 2))
        rec.update(step_s=round(logp_s + update_s, 2), peak_gib=round(peak, 1))
        rec.update(encoded=encoded, mbs=mbs)
    except Exception as exc:  # an out-of-memory layout must not lose the others
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rec


def table() -> str:
    head = (
        "actor             layout     T  rows  tokens  images encoded  mbs  logp_s  update_s  step_s"
        "  peak_GiB"
    )
    lines = [head]
    for r in RESULTS:
        if "actor" not in r or "layout" not in r:
            continue
        if "error" in r:
            lines.append(f"{r['actor']:<17} {r['layout']:<9} {r['turns']:>2}  {r['error'][:100]}")
            continue
        lines.append(
            f"{r['actor']:<17} {r['layout']:<9} {r['turns']:>2} {r['rows']:>5} {r['tokens']:>7} "
            f"{r['row_images']:>7} {r['encoded']:>7} {r['mbs']:>4} {r['logp_s']:>7.2f} "
            f"{r['update_s']:>9.2f} {r['step_s']:>7.2f} {r['peak_gib']:>9.1f}"
        )
    done = {
        (r["actor"], r["layout"], r["turns"]): r for r in RESULTS if "step_s" in r and "actor" in r
    }
    lines.append("step time against the same actor's full row, and each cua actor against areal:")
    for (actor, layout, turns), r in done.items():
        full = done.get((actor, "full", turns))
        if layout != "full" and full:
            lines.append(f"  {actor} {layout} T={turns}: {r['step_s'] / full['step_s']:.2f}x")
    for (actor, layout, turns), r in done.items():
        other = done.get(("areal", layout, turns))
        if actor != "areal" and other:
            ratio = r["step_s"] / other["step_s"]
            lines.append(f"  {actor}/areal {layout} T={turns}: {ratio:.2f}x")
    return "\n".join(lines)


def note_cpu_statistics() -> None:
    """Name each statistic made on the CPU that reaches the all-reduce (NCCL refuses them)."""
    from areal.utils import stats_tracker

    aggregate = stats_tracker.DistributedStatsTracker._aggregate
    seen: set[str] = set()

    def noting(self, key, reduce_group):
        values = self.stats.get(key) or []
        on_cpu = any(
            getattr(v, "device", None) is not None and v.device.type == "cpu" for v in values
        )
        if on_cpu and key not in seen:
            seen.add(key)
            log(f"  CPU statistic (NCCL refuses it): {key}")
            RESULTS.append(dict(cpu_statistic=key))
        return aggregate(self, key, reduce_group)

    stats_tracker.DistributedStatsTracker._aggregate = noting


def smoke() -> None:
    """--check's GPU step (cua_rl.testing.gpu_step), as the check prints it, per family: each a
    PPO step in bf16 with gradient checkpointing and its recompute check (the same update with
    and without checkpointing, gradients compared), MAI-UI's family first, untied as MAI-UI-8B
    and tied as Qwen3-VL-2B."""
    from cua_rl.app.check_gpu import step_lines
    from cua_rl.areal.vision import VisionSection
    from cua_rl.testing.gpu_step import run

    # Qwen3-VL stopped here on an H200 (2026-11-27) before cua_rl/areal/recompute.py: the
    # recompute of torch <= 2.12 left a vision block's input in fp32.
    variants = [
        ("qwen3-vl", {}),
        ("qwen3-vl", {"tied": True}),
        ("qwen3-vl", {"vision": VisionSection(dedup=False).__dict__, "selective": False}),
        ("qwen2-vl", {}),
        ("qwen2.5-vl", {}),
        ("qwen3-vl-moe", {}),
        # The control: the same Qwen3-VL step without the rule, which the node's torch must
        # stop (<= 2.12) or pass (>= 2.13) on its own: it says which torch behaviour is here.
        ("qwen3-vl", {"control": "rule off"}),
    ]
    import cua_rl.areal.actor as actor_module

    rule = actor_module.cast_recomputed_inputs
    for family, change in variants:
        control = change.pop("control", "")
        actor_module.cast_recomputed_inputs = (lambda model: 0) if control else rule
        spec = {
            "family": family,
            "tied": False,
            "dtype": "bfloat16",
            "attn_impl": "sdpa",
            "vision": VisionSection().__dict__,
            "selective": True,
            "gradient_checkpointing": True,
        } | change
        try:
            result = run(spec)
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        finally:
            actor_module.cast_recomputed_inputs = rule
        RESULTS.append(dict(smoke=family, spec=spec, control=control, **result))
        dump()
        for line in step_lines(spec, result):
            log(
                (f"[control, {control}: expected to fail on torch <= 2.12] " if control else "")
                + line.line()
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--turns", type=int, nargs="+", default=[30])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--actors", nargs="+", default=["cua", "areal"], choices=list(ACTORS))
    ap.add_argument("--image-tokens", type=int, default=1296, help="merged tokens per screenshot")
    ap.add_argument("--mb-tokens", type=int, default=49152, help="max_tokens_per_mb")
    ap.add_argument("--budget-s", type=float, default=480, help="no new layout after this")
    ap.add_argument("--smoke", action="store_true", help="--check's GPU step first")
    ap.add_argument("--small", action="store_true", help="tiny sizes, fp32: check the script")
    args = ap.parse_args()
    sys.meta_path.insert(0, _StubFinder())
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig
    from areal.engine.fsdp_engine import FSDPPPOActor

    from cua_rl.areal.actor import CuaPPOActor
    from cua_rl.areal.logits_engine import SelectiveLogitsPPOActor
    from cua_rl.areal.vision import VisionSection
    from cua_rl.testing.actor import actor_config

    if cuda:  # on a CPU every statistic is a CPU tensor, and gloo takes them
        note_cpu_statistics()
    if args.smoke:
        smoke()
    folder = model_dir(args.small)
    random_init_instead_of_loading()
    dtype = "bfloat16" if cuda and not args.small else "float32"
    classes = {"selective": SelectiveLogitsPPOActor, "cua": CuaPPOActor, "areal": FSDPPPOActor}
    for name in args.actors:
        kind, dedup = ACTORS[name]
        config = actor_config(
            folder,
            dtype=dtype,
            attn_impl="sdpa",
            gradient_checkpointing=not args.small,
            mb_spec=MicroBatchSpec(max_tokens_per_mb=args.mb_tokens),
            optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.0),
            vision=VisionSection(dedup=dedup),
        )
        cls = classes[kind]
        try:
            bench_actor(name, cls, config, args)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            RESULTS.append(dict(actor=name, layout="*", turns=0, error=repr(exc)[:300]))
            dump()
    text = table()
    print(text, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_actor.txt").write_text(f"{device}, torch {torch.__version__}\n{text}\n")
    dump()


if __name__ == "__main__":
    main()
