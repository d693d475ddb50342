"""The FSDP actor every cua-rl training runs, selective logits or not, and the trainer factory.

AReaL's controller sends each training worker its engine class by dotted path; the worker imports
that module and nothing else of cua-rl. The correctness fixes the worker needs (transformers'
Qwen2.5-VL image positions, ``cua_rl.areal.positions``; SDPA within each packed sequence,
``cua_rl.areal.attention``) are therefore applied by importing this module, and every fsdp train
engine (actor, reference, teacher) is made from a class defined here or in a module that imports
it: ``CuaPPOActor`` (AReaL's ``FSDPPPOActor`` with the vision deduplication of
``cua_rl.areal.vision_dedup``, switched by ``actor.vision.dedup``) when ``logits.selective`` is
off, ``logits_engine.SelectiveLogitsPPOActor`` (its subclass) when on. So an optimisation switch
never decides whether a fix applies. With gradient checkpointing, ``CuaPPOActor.initialize``
makes each checkpointed layer's recompute cast its inputs as the forward did, which torch <= 2.12
does not (``cua_rl.areal.recompute``). ``CuaPPOActor.ppo_update`` returns the heap's free pages after
each update (``cua_rl.heap``); ``compute_advantages`` keeps each row's own images (AReaL's would
hand every row a copy of the whole batch's), and adds each token's step advantage when the rows
carry one (``step_credit``: ``cua_rl.credit.trainer``).

``ActorMixin`` overrides ``PPOTrainer._create_train_engine`` (declared in ``cua_rl.areal.support``)
with AReaL's fsdp branch and ``actor_class``; other backends (megatron, archon) are AReaL's own,
whose models are not transformers' and get no fix. It also gives the scheduler the config's
``worker_startup_s`` (``_init_scheduler``: its start-up timeout, and the wait for a worker it
forks from another), and stops the workers when the trainer's construction
fails (``Scheduler.delete_workers``: no trainer exists then to close them).
"""

from __future__ import annotations

import functools
from typing import Any

from areal import PPOTrainer
from areal.engine.fsdp_engine import FSDPPPOActor
from areal.infra.scheduler.local import LocalScheduler
from areal.infra.scheduler.slurm import SlurmScheduler
from areal.utils.data import batched_call
from areal.utils.environ import is_single_controller

from cua_rl.areal.attention import keep_packed_sequences_apart
from cua_rl.areal.positions import fix_qwen2_5_vl_image_positions
from cua_rl.areal.recompute import cast_recomputed_inputs
from cua_rl.areal.vision_dedup import VisionDedupMixin
from cua_rl.credit.trainer import advantages_with_steps, carries_steps
from cua_rl.heap import hold_mmap_threshold, release_free_memory

# The schedulers whose forked workers are waited for with a timeout of their own.
FORKS_WAITED = (LocalScheduler, SlurmScheduler)

# Workers import this module by the engine's dotted path: the trainer's Qwen2.5-VL positions
# then match vLLM's.
fix_qwen2_5_vl_image_positions()
# actor.attn_impl: sdpa attends within each packed sequence only (cua_rl/areal/attention.py).
keep_packed_sequences_apart()
# Each update's tensors keep their own mappings, returned when freed (cua_rl/heap.py).
hold_mmap_threshold()


class CuaPPOActor(VisionDedupMixin, FSDPPPOActor):
    """AReaL's FSDP PPO actor with each distinct screenshot of a micro-batch through the vision
    tower once (``actor.vision``, ``cua_rl.areal.vision_dedup``); its module applies the
    trainer-side fixes on import."""

    def initialize(self, *args, **kwargs):
        result = super().initialize(*args, **kwargs)
        if self.config.gradient_checkpointing:
            # The recompute casts as the forward did on every torch, not only >= 2.13
            # (cua_rl/areal/recompute.py).
            hooked = cast_recomputed_inputs(self.model)
            self.logger.info(f"recompute casts as the forward: {hooked} FSDP units hooked")
        return result

    def compute_advantages(self, data: list[dict[str, Any]], *args, **kwargs) -> list[dict]:
        # AReaL's batched_call splits the batch back into rows with split_and_unpad_tensor,
        # which deep-copies every non-tensor value into each row: each row would come back
        # with a copy of the whole batch's multi_modal_input, rows x rows copies of the pixels
        # (60 per-call rows of 5 screenshots: about 11 GiB at the bench's tiny screenshots).
        # The advantages read no image: the rows' own media go around the call.
        if not any("multi_modal_input" in row for row in data):
            return self._advantages(data, *args, **kwargs)
        media = [row.get("multi_modal_input") for row in data]
        bare = [{k: v for k, v in row.items() if k != "multi_modal_input"} for row in data]
        rows = self._advantages(bare, *args, **kwargs)
        for row, own in zip(rows, media, strict=True):
            if own is not None:
                row["multi_modal_input"] = own
        return rows

    def _advantages(self, data: list[dict[str, Any]], *args, **kwargs) -> list[dict]:
        if not carries_steps(data):
            return super().compute_advantages(data, *args, **kwargs)
        # Step credit: AReaL's computation on the batch, each token's step advantage added
        # before AReaL's normalisation (cua_rl/credit/trainer.py says why it must be there).
        return batched_call(functools.partial(advantages_with_steps, self.actor), data)

    def ppo_update(self, *args, **kwargs) -> None:
        super().ppo_update(*args, **kwargs)
        # Each update frees tensors of this step's shapes; give the pages back (cua_rl/heap.py).
        release_free_memory()


class ActorMixin:
    """Put before a ``PPOTrainer`` (sub)class: its fsdp train engines are ``actor_class``."""

    actor_class: type[FSDPPPOActor] = CuaPPOActor

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # PPOTrainer.__init__ starts the workers, then initializes their engines; when that
            # fails (unreadable weights, a worker that dies), no trainer exists to close them,
            # and AReaL's schedulers stop their workers only in __del__, which the exception's
            # traceback keeps from running: the workers outlived the launcher, holding its
            # output open. Stop them before the error goes up.
            scheduler = getattr(self, "scheduler", None)
            if scheduler is not None:
                try:
                    scheduler.delete_workers()
                except Exception as exc:  # the construction's error is the one to report
                    print(f"stopping the workers after a failed start failed: {exc!r}")
            raise

    def _create_train_engine(self, actor_config, alloc):
        if alloc.backend != "fsdp":
            return super()._create_train_engine(actor_config, alloc)
        # AReaL's fsdp branch with our class: a controller sends workers the class's dotted
        # path, which they import; without a controller the engine lives in this process.
        if is_single_controller():
            actor = self.actor_class.as_controller(actor_config, self.scheduler)
        else:
            actor = self.actor_class(config=actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor

    def _init_scheduler(self):
        scheduler = super()._init_scheduler()
        # AReaL constructs its schedulers without a start-up timeout (30 s for local and Ray),
        # and gives the config no field for it. AReaL's own config (cua_rl/cpu/smoke.py) has
        # none of ours: it keeps the scheduler's default.
        startup_s = getattr(self.config, "worker_startup_s", None)
        if startup_s is not None:
            scheduler.startup_timeout = startup_s
            # A worker forked from another (the eval rollout worker from the rollout worker) is
            # waited for 60 s whatever startup_timeout says (_wait_for_fork_ready's default, local
            # and Slurm): a cold eval worker on a busy machine answered after 63 s in a suite run
            # and failed its training. On this scheduler only, it waits worker_startup_s too.
            if isinstance(scheduler, FORKS_WAITED):
                scheduler._wait_for_fork_ready = functools.partial(
                    scheduler._wait_for_fork_ready, timeout=startup_s
                )
        return scheduler

    def _init_rollout(self, rollout_config, is_eval=False, lora_path=None):
        # AReaL starts an eval rollout worker whether or not there is anything to evaluate;
        # train.py passes no valid dataset when the gym gives no eval task or the run never
        # evaluates (cua_rl.app.train.evaluates), and AReaL's
        # evaluation, baseline and shutdown all skip an absent eval rollout. Not starting it
        # saves a worker process (torch, AReaL and a rollout engine: ~7 CPU s to start, ~0.5 GiB).
        if is_eval and self.valid_dataloader is None:
            return None
        return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)


class CuaTrainer(ActorMixin, PPOTrainer):
    """``PPOTrainer`` whose fsdp train engines are ``CuaPPOActor``."""


def mixed_trainer(base: type, mixin: type, plain: type, prefix: str) -> type:
    """``base`` (``PPOTrainer`` or a subclass of it) with ``mixin`` in front; ``plain`` is the
    named class for ``PPOTrainer`` itself."""
    if not issubclass(base, PPOTrainer):
        raise TypeError(f"{base.__name__} is not a PPOTrainer")
    if issubclass(base, mixin):
        return base
    if base is PPOTrainer:
        return plain
    return type(f"{prefix}{base.__name__}", (mixin, base), {})


@functools.cache
def with_actor(base: type) -> type:
    """``base`` (``PPOTrainer`` or a subclass of it) with ``ActorMixin`` in front."""
    return mixed_trainer(base, ActorMixin, CuaTrainer, "Cua")
