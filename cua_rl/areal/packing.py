"""Micro-batches in row order, so an episode's rows stay together and in turn order.

AReaL 1.0.4 packs a batch's rows into micro-batches first-fit decreasing by length
(``areal.utils.seqpack.ffd_allocate``), which scatters an episode's per-call rows: a screenshot
that 3 rows share is then encoded in up to 3 micro-batches, and per-micro-batch deduplication
(``cua_rl.areal.vision_dedup``) keeps little of its saving. An episode's rows arrive contiguous
and in turn order (the workflow hands AReaL one batch per episode, AReaL's controller dispatches
whole episodes to ranks, the worker concatenates them), so filling micro-batches in row order
keeps an episode's rows in as few micro-batches as its tokens need, cut only where one is full.

``sequential_allocate`` keeps ``ffd_allocate``'s contract (capacity, at least ``min_groups``
groups, a count divisible by ``n_groups_divisor``), so AReaL's synchronisation of micro-batch
counts across ranks (``allocate_balanced_mbs_synced``) works unchanged. ``in_row_order`` makes
AReaL's packer use it for the span of one call (``VisionDedupMixin._prepare_mb_list``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cua_rl.errors import CuaRlError


def sequential_allocate(
    values: list[int], capacity: int, min_groups: int | None, n_groups_divisor: int = 1
) -> list[list[int]]:
    """Indices ``0..len(values)-1`` in contiguous groups of at most ``capacity`` tokens each,
    filled in order; the fullest groups are then halved until there are at least ``min_groups``
    groups and their number divides by ``n_groups_divisor``."""
    if any(v > capacity for v in values):
        raise CuaRlError(f"a row of {max(values)} tokens exceeds max_tokens_per_mb={capacity}")
    groups: list[list[int]] = []
    total = capacity + 1
    for i, v in enumerate(values):
        if total + v > capacity:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += v
    need = max(min_groups or 1, 1)
    while len(groups) < need or len(groups) % n_groups_divisor:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise CuaRlError(
                f"{len(values)} rows cannot fill {need} micro-batches divisible by "
                f"{n_groups_divisor}"
            )
        group = max(splittable, key=lambda g: sum(values[i] for i in g))
        at = groups.index(group)
        cut = _half(group, values)
        groups[at : at + 1] = [group[:cut], group[cut:]]
    return groups


def _half(group: list[int], values: list[int]) -> int:
    """The cut (1..len-1) that best balances the group's tokens between its two halves."""
    total = sum(values[i] for i in group)
    best, best_gap, left = 1, None, 0
    for k in range(1, len(group)):
        left += values[group[k - 1]]
        gap = abs(total - 2 * left)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best


@contextlib.contextmanager
def in_row_order() -> Iterator[None]:
    """AReaL's micro-batch packer allocates with ``sequential_allocate`` inside the block."""
    from areal.utils import data

    # Declared in cua_rl.areal.support: AReaL's packer looks the allocator up by this name.
    original = data.get_allocate_fn
    data.get_allocate_fn = lambda algorithm="ffd": sequential_allocate
    try:
        yield
    finally:
        data.get_allocate_fn = original
