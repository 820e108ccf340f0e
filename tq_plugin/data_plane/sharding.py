"""Data-parallel sharding of a step's metadata: ``shard_meta_for_dp``.

Pure metadata: it reads ``meta.sequence_lengths`` only, never a tensor, never a backend, and never
mints a key. Each DP rank gets a ``KVBatchMeta`` naming its rows; with packing it also gets the
microbatch plan its worker must follow, so no rank re-packs locally (local re-packing gives
ranks different microbatch counts, and the collectives of the step then deadlock).

Rules (each violated one is a ``ValueError`` naming the argument, or a ``TypeError`` when the
argument has the wrong type: ``meta`` not a ``KVBatchMeta``, a non-int ``dp_world`` /
``batch_size`` / packing budget, non-integer lengths, a packing argument that is not a dict):

* ``meta`` is non-empty, its ``sample_ids`` are unique (each key goes to exactly one rank), and
  it has one ``sequence_lengths`` entry (a non-negative int) and, when tagged, one tag per row;
* ``dp_world >= 1``;
* at most one of ``sequence_packing_args`` / ``dynamic_batching_args``;
* ``batch_size`` (default ``meta.size``) is the global batch: ``meta.size`` must be a multiple of
  ``batch_size``, and ``batch_size`` a multiple of ``dp_world``. Global batch ``g`` is rows
  ``[g * batch_size, (g + 1) * batch_size)`` of ``meta``; every rank gets rows of each global
  batch, global batch by global batch, so a rank's rows for batch ``g`` are contiguous.

Within a global batch:

* **No packing**: every rank gets exactly ``batch_size // dp_world`` rows, length-balanced (rows
  longest first to the least-loaded rank in tokens that still has room); a rank keeps its rows
  in their original relative order.
* **Sequence packing / dynamic batching**: rows are planned into microbatches over the whole
  global batch (:func:`tq_plugin.data_plane.microbatches.plan_microbatches`), their count is raised
  to a multiple of ``dp_world`` (packed rows are re-packed into that many token-balanced bins
  when they fit the budget; otherwise the costliest microbatches are split), and the
  microbatches are dealt so every rank gets the same number, balancing tokens (costliest first
  to the least-loaded rank with room). Row counts per rank may then differ. A rank keeps its
  microbatches in plan order, each microbatch's rows contiguous.

``extra_info`` of each shard is a shallow copy of the parent's (so ``global_forward_pad_seqlen``
minted on the whole meta reaches every rank), without ``rollout_metrics`` and without any stale
microbatch plan; with packing it adds, per global batch ``g``:

* ``micro_batch_indices[g]``: list of ``[start, end)`` row ranges, as 2-lists, into *the shard*
  (absolute shard row positions, in the shard's row order; consecutive and covering that global
  batch's rows of the shard);
* ``micro_batch_lengths[g]``: each microbatch's token length — under sequence packing the packed
  row's length ``sum(round_up(len, sequence_length_pad_multiple))`` (``<=
  max_tokens_per_microbatch``; pad to ``max_tokens_per_microbatch`` yourself if you want
  fixed-shape bins), under dynamic batching ``round_up(max len, sequence_length_round)``;
* ``elem_counts_per_gb[g]``: the number of the shard's rows in global batch ``g``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.microbatches import (
    balanced_equal_count,
    plan_microbatches,
)
from tq_plugin.data_plane.packing_args import (
    as_lengths,
    validate_dynamic_batching_args,
    validate_sequence_packing_args,
)
from tq_plugin.data_plane.schema import (
    ELEM_COUNTS_PER_GB,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
    ROLLOUT_METRICS,
)

_PLAN_KEYS = (MICRO_BATCH_INDICES, MICRO_BATCH_LENGTHS, ELEM_COUNTS_PER_GB)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"shard_meta_for_dp: {name} must be a positive int, got {type(value).__name__} "
            f"{value!r}"
        )
    if value < 1:
        raise ValueError(f"shard_meta_for_dp: {name} must be a positive int, got {value!r}")
    return int(value)


def _validate(
    meta: KVBatchMeta,
    dp_world: Any,
    batch_size: Any,
    sequence_packing_args: Mapping[str, Any] | None,
    dynamic_batching_args: Mapping[str, Any] | None,
) -> tuple[torch.Tensor, int, int]:
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"shard_meta_for_dp: meta must be a KVBatchMeta, got {type(meta).__name__}")
    if meta.size == 0:
        raise ValueError("shard_meta_for_dp: meta is empty (no sample_ids to shard)")
    if meta.sequence_lengths is None:
        raise ValueError(
            "shard_meta_for_dp: meta.sequence_lengths is missing; length-balanced sharding needs "
            "one length per row"
        )
    if len(meta.sequence_lengths) != meta.size:
        raise ValueError(
            f"shard_meta_for_dp: meta.sequence_lengths has {len(meta.sequence_lengths)} entries "
            f"for {meta.size} sample_ids"
        )
    if meta.tags is not None and len(meta.tags) != meta.size:
        raise ValueError(
            f"shard_meta_for_dp: meta.tags has {len(meta.tags)} entries for {meta.size} sample_ids"
        )
    if len(set(meta.sample_ids)) != meta.size:
        seen: set[str] = set()
        dups = sorted({s for s in meta.sample_ids if s in seen or seen.add(s)})  # type: ignore[func-returns-value]
        raise ValueError(
            f"shard_meta_for_dp: meta.sample_ids must be unique (a key goes to one rank); "
            f"duplicated: {dups[:5]}"
        )
    lengths = as_lengths(meta.sequence_lengths, name="meta.sequence_lengths")
    if sequence_packing_args is not None and dynamic_batching_args is not None:
        raise ValueError(
            "shard_meta_for_dp: pass at most one of sequence_packing_args and "
            "dynamic_batching_args (the two modes are mutually exclusive)"
        )
    dp_world = _check_int("dp_world", dp_world)
    batch = meta.size if batch_size is None else _check_int("batch_size", batch_size)
    if meta.size % batch:
        raise ValueError(
            f"shard_meta_for_dp: batch_size={batch} must divide meta.size={meta.size} into whole "
            "global batches"
        )
    if batch % dp_world:
        what = f"batch_size={batch}" if batch_size is not None else f"meta.size={batch}"
        raise ValueError(
            f"shard_meta_for_dp: {what} must be a multiple of dp_world={dp_world} (each global "
            "batch is split over every rank)"
        )
    if sequence_packing_args is not None:
        validate_sequence_packing_args(sequence_packing_args)
    if dynamic_batching_args is not None:
        validate_dynamic_batching_args(dynamic_batching_args)
    return lengths, dp_world, batch


def shard_meta_for_dp(
    meta: KVBatchMeta,
    *,
    dp_world: int,
    batch_size: int | None = None,
    sequence_packing_args: Mapping[str, Any] | None = None,
    dynamic_batching_args: Mapping[str, Any] | None = None,
) -> tuple[list[KVBatchMeta], list[int] | None]:
    """Split ``meta`` over ``dp_world`` ranks, length-balanced; see the module docstring.

    Returns ``(shards, unsorted_indices)``: ``shards[r]`` is rank ``r``'s meta; keys across shards
    are disjoint and cover ``meta.sample_ids`` exactly. ``unsorted_indices`` is the inverse
    permutation from the rank-concatenation order back to ``meta``'s order (row ``i`` of ``meta``
    is row ``unsorted_indices[i]`` of ``concat(shards)``, so ``cat(per_rank_results)[unsorted]``
    restores the original order), or ``None`` when the concatenation is already in order.
    """
    lengths, dp_world, batch = _validate(
        meta, dp_world, batch_size, sequence_packing_args, dynamic_batching_args
    )
    packing = sequence_packing_args is not None or dynamic_batching_args is not None
    rank_rows: list[list[int]] = [[] for _ in range(dp_world)]
    plans: list[dict[str, list]] = [{k: [] for k in _PLAN_KEYS} for _ in range(dp_world)]

    for start in range(0, meta.size, batch):
        gb_lengths = lengths[start : start + batch]
        if not packing:
            groups = balanced_equal_count(gb_lengths.tolist(), dp_world)
            for rank, rows in enumerate(groups):
                rank_rows[rank].extend(start + i for i in rows)
            continue
        mbs, mbl = plan_microbatches(
            gb_lengths,
            sequence_packing_args=sequence_packing_args,
            dynamic_batching_args=dynamic_batching_args,
            count_multiple=dp_world,
        )
        if sequence_packing_args is not None:
            costs = mbl
        else:
            costs = [length * len(mb) for mb, length in zip(mbs, mbl)]
        for rank, units in enumerate(balanced_equal_count(costs, dp_world)):
            rows = rank_rows[rank]
            ranges, mb_lengths, first = [], [], len(rows)
            for u in units:  # ascending: plan order
                ranges.append([len(rows), len(rows) + len(mbs[u])])
                rows.extend(start + i for i in mbs[u])
                mb_lengths.append(mbl[u])
            plans[rank][MICRO_BATCH_INDICES].append(ranges)
            plans[rank][MICRO_BATCH_LENGTHS].append(mb_lengths)
            plans[rank][ELEM_COUNTS_PER_GB].append(len(rows) - first)

    shards = []
    for rank in range(dp_world):
        shard = meta.subset(rank_rows[rank])
        extra = shard.extra_info  # already a fresh shallow copy of meta.extra_info
        for key in (ROLLOUT_METRICS, *_PLAN_KEYS):
            extra.pop(key, None)
        if packing:
            extra.update(plans[rank])
        shards.append(shard)

    order = [i for rows in rank_rows for i in rows]
    if order == list(range(meta.size)):
        return shards, None
    inverse = torch.empty(meta.size, dtype=torch.int64)
    inverse[torch.as_tensor(order, dtype=torch.int64)] = torch.arange(meta.size)
    return shards, inverse.tolist()
