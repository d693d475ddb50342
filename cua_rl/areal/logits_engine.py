"""Logits only where the loss reads them, for AReaL 1.0.4's FSDP actor.

AReaL's ``FSDPEngine.forward_backward_batch`` takes ``outputs.logits`` for a whole packed
micro-batch, ``[tokens, vocabulary]``, and its callbacks gather logprobs and entropy from it at
every position. A GUI episode's row is mostly screenshot tokens and only the positions before
sampled tokens carry loss, yet that tensor (151,936 columns for Qwen-VL models) is kept for the
backward pass at every position. docs/logits.md has the measurements.

``SelectiveLogitsPPOActor`` is AReaL's ``FSDPPPOActor`` with six methods overridden (no AReaL
file, class or function is modified):

- ``forward_backward_batch`` scopes the plans below to its own micro-batch loop, and
  ``_prepare_mb_inputs`` plans, per micro-batch, the positions that need logits: those in the
  loss mask or followed by a position in it. Callers pass the mask shifted (``ppo_update``) or
  not (``compute_logp``); the union serves both at the cost of one extra row per sampled span.
- A forward pre-hook on the output embedding (``lm_head``) hands the head only those rows. In
  the same call, where FSDP has gathered the head's weight, it also computes AReaL's
  ``vocab_min_logits`` / ``vocab_max_logits`` statistics (logged over every token) without
  autograd, a few hundred rows at a time. ``forward_batch`` logs no such statistic and skips it.
- ``_compute_logprobs``, ``_compute_logprobs_entropy`` and ``_get_vocab_min_max_logits`` gather
  with AReaL's own functions on the compact logits and scatter back to full length (zeros at
  the positions not computed, which every loss term and statistic masks out), so the loss, the
  gradients and the logged statistics are those of AReaL's path.

Layouts it does not cover (tensor or sequence parallelism, tree training, critics, micro-batches
without a loss mask, a model without an output embedding) take AReaL's path unchanged.
``SelectiveLogitsMixin`` (``cua_rl.areal.actor.ActorMixin`` with this class) makes a
``PPOTrainer`` (or a subclass, such as a trainer with its own data loader) create this actor,
and the reference and teacher models, for the fsdp backend; workers import the engine class by
its dotted path, so it works under any scheduler.
``SelectiveLogitsTrainer`` is ``PPOTrainer`` with it; ``cua_rl.areal.logits.trainer_class``
picks the trainer from the config.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from areal import PPOTrainer
from areal.utils.functional import gather_logprobs, gather_logprobs_entropy

from cua_rl.areal.actor import ActorMixin, CuaPPOActor, mixed_trainer
from cua_rl.areal.support import SUPPORTED_AREAL, check_areal_version
from cua_rl.errors import CuaRlError
from cua_rl.logs import get_logger

log = get_logger(__name__)

# Rows per chunk of the statistics pass: its transient is STATS_CHUNK_TOKENS x vocabulary
# logits (about 78 MB in bf16 for a Qwen-VL head), and a GPU still runs full-size GEMMs.
STATS_CHUNK_TOKENS = 256


def loss_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Indices into a packed row whose logits a loss or a per-token statistic reads.

    A position counts if it is in the mask or the next one is: ``compute_logp`` receives the
    mask over sampled tokens (the logprob at i belongs to token i + 1), ``ppo_update`` the mask
    already shifted by one. Never empty: a micro-batch with nothing to train still runs the
    head once, as AReaL's zero-loss branch needs a logits tensor with elements.
    """
    mask = loss_mask.reshape(-1) != 0
    keep = (mask | torch.roll(mask, shifts=-1)).nonzero().squeeze(1)
    if keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=loss_mask.device)
    return keep


@dataclass
class _Plan:
    """The positions of one micro-batch, and what the head computed for them."""

    keep: torch.Tensor
    length: int
    want_stats: bool
    applied: bool = False
    vocab_min: torch.Tensor | None = None
    vocab_max: torch.Tensor | None = None

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        # Out of place, so autograd carries the gradient back to the computed rows.
        return values.new_zeros(self.length).index_copy(0, self.keep, values)


class SelectiveLogitsPPOActor(CuaPPOActor):
    """``FSDPPPOActor`` (through ``CuaPPOActor``, whose module applies the trainer-side fixes) whose LM head and log-softmax run only at the loss positions."""

    def __init__(self, config: Any):
        check_areal_version()
        super().__init__(config)
        self._plan: _Plan | None = None
        self._planning = False
        self._stats_wanted = True
        # None until the first micro-batch decides; then "" (selective) or why not.
        self._fallback: str | None = None

    def _unsupported(self) -> str:
        helper = self.parallel_helper
        if self.config.is_critic:
            return "a critic reads values, not logits"
        if self.enable_tree_training:
            return "tree training packs shared prefixes"
        if helper.tp_size > 1:
            return f"tensor parallelism (tp={helper.tp_size}) shards the head"
        if helper.sp_size > 1:
            return f"sequence parallelism (sp={helper.sp_size}) splits the rows"
        if self.model.get_output_embeddings() is None:
            return "the model has no output embedding"
        return ""

    def _selective(self) -> bool:
        if self._fallback is None:
            self._fallback = self._unsupported()
            if self._fallback:
                log.warning("selective logits off for this engine: %s", self._fallback)
            else:
                self.model.get_output_embeddings().register_forward_pre_hook(self._head_inputs)
                log.info("selective logits on: the LM head runs only at loss positions")
        return not self._fallback

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        if not self._selective():
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        self._planning = True
        try:
            return super().forward_backward_batch(mb_list, process_output_fn, forward_only)
        finally:
            self._planning = False
            self._plan = None

    def forward_batch(self, *args, **kwargs):
        # compute_logp gathers logprobs only (_compute_forward_result): no vocabulary statistics.
        self._stats_wanted = False
        try:
            return super().forward_batch(*args, **kwargs)
        finally:
            self._stats_wanted = True

    def _prepare_mb_inputs(self, mb_item):
        inputs, ctx = super()._prepare_mb_inputs(mb_item)
        self._plan = None
        if self._planning and isinstance(inputs.get("loss_mask"), torch.Tensor):
            self._plan = _Plan(
                keep=loss_positions(inputs["loss_mask"]),
                length=inputs["input_ids"].shape[-1],
                want_stats=self._stats_wanted,
            )
        return inputs, ctx

    def _head_inputs(self, head: torch.nn.Module, args: tuple) -> tuple | None:
        """Forward pre-hook of the LM head: keep the planned rows, take statistics of all."""
        plan = self._plan
        if plan is None or plan.applied or not args:
            return None
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] != plan.length:
            return None
        if plan.want_stats:
            # What AReaL's _get_vocab_min_max_logits takes from the full logits, row by row.
            with torch.no_grad():
                lows, highs = [], []
                for start in range(0, plan.length, STATS_CHUNK_TOKENS):
                    logits = head.forward(hidden[0, start : start + STATS_CHUNK_TOKENS])
                    lows.append(logits.min(-1).values.float())
                    highs.append(logits.max(-1).values.float())
                plan.vocab_min, plan.vocab_max = torch.cat(lows), torch.cat(highs)
        plan.applied = True
        return (hidden[:, plan.keep], *args[1:])

    def _compact(self, logits: torch.Tensor) -> _Plan | None:
        """The plan whose rows ``logits`` holds, or None when the head saw the full row."""
        plan = self._plan
        if plan is not None and plan.applied and logits.shape[0] == plan.keep.numel():
            return plan
        return None

    @staticmethod
    def _labels(plan: _Plan, inputs: dict[str, Any]) -> torch.Tensor:
        # AReaL's labels (the next token, rolled over the packed row), at the planned rows.
        return torch.roll(inputs["input_ids"], shifts=-1, dims=-1).reshape(-1)[plan.keep]

    def _compute_logprobs_entropy(self, logits, inputs, ulysses_pad_size: int = 0):
        plan = self._compact(logits)
        if plan is None:
            return super()._compute_logprobs_entropy(logits, inputs, ulysses_pad_size)
        logprobs, entropy = gather_logprobs_entropy(
            logits, self._labels(plan, inputs), temperature=self.config.temperature
        )
        return plan.scatter(logprobs), plan.scatter(entropy)

    def _compute_logprobs(self, logits, inputs, ulysses_pad_size: int = 0):
        plan = self._compact(logits)
        if plan is None:
            return super()._compute_logprobs(logits, inputs, ulysses_pad_size)
        logprobs = gather_logprobs(
            logits, self._labels(plan, inputs), temperature=self.config.temperature
        )
        return plan.scatter(logprobs)

    def _get_vocab_min_max_logits(self, logits, ulysses_pad_size: int = 0):
        plan = self._compact(logits)
        if plan is None:
            return super()._get_vocab_min_max_logits(logits, ulysses_pad_size)
        if plan.vocab_min is None or plan.vocab_max is None:
            raise CuaRlError(
                "vocabulary statistics were requested from forward_batch, which AReaL "
                f"{SUPPORTED_AREAL} never does: set logits.selective=false and report this"
            )
        return plan.vocab_min, plan.vocab_max


class SelectiveLogitsMixin(ActorMixin):
    """Put before a ``PPOTrainer`` (sub)class: its fsdp train engines become selective."""

    actor_class = SelectiveLogitsPPOActor


class SelectiveLogitsTrainer(SelectiveLogitsMixin, PPOTrainer):
    """``PPOTrainer`` whose fsdp train engines (actor, reference, teacher) are selective."""


@functools.cache
def with_selective_logits(base: type) -> type:
    """``base`` (``PPOTrainer`` or a subclass of it) with ``SelectiveLogitsMixin`` in front."""
    return mixed_trainer(base, SelectiveLogitsMixin, SelectiveLogitsTrainer, "SelectiveLogits")
