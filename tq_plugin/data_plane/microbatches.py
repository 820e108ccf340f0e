"""Microbatches from a planner's bins: their lengths, equal microbatch counts across
data-parallel ranks (split or pack a plan to a given count), the planned microbatches of a
global batch, and the padded-token fraction a plan costs. Errors as in ``packing``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tq_plugin.data_plane.packing import (
    MicroBatchMode,
    _rounded,
    plan_dynamic_batches,
    plan_sequence_packing,
)
from tq_plugin.data_plane.packing_args import (
    as_lengths,
    validate_dynamic_batching_args,
    validate_sequence_packing_args,
)


def micro_batch_lengths(
    lengths: Sequence[int] | torch.Tensor,
    micro_batches: Sequence[Sequence[int]],
    *,
    mode: MicroBatchMode,
    multiple: int = 1,
) -> list[int]:
    """The token length of each microbatch, as ``extra_info["micro_batch_lengths"]`` records it.

    ``mode="packed"``: ``sum(round_up(len_i, multiple))`` over the microbatch (its packed row);
    ``mode="padded"``: ``round_up(max len_i, multiple)`` (its rectangle's dim 1).
    Empty microbatches have length 0.
    """
    if mode not in ("packed", "padded"):
        raise ValueError(f"mode must be 'packed' or 'padded', got {mode!r}")
    lens = _rounded(as_lengths(lengths, name="lengths"), int(multiple))
    return _reduce_per_mb(lens, micro_batches, mode).tolist()


def _reduce_per_mb(
    lens_rounded: torch.Tensor, micro_batches: Sequence[Sequence[int]], mode: MicroBatchMode
) -> torch.Tensor:
    """Per-microbatch sum (``"packed"``) or max (``"padded"``) of rounded lengths (one scatter)."""
    rows = torch.tensor([i for mb in micro_batches for i in mb], dtype=torch.int64)
    owner = torch.tensor([k for k, mb in enumerate(micro_batches) for _ in mb], dtype=torch.int64)
    out = torch.zeros(len(micro_batches), dtype=torch.int64)
    if rows.numel():
        reduce = "sum" if mode == "packed" else "amax"
        out.scatter_reduce_(0, owner, lens_rounded[rows], reduce=reduce, include_self=True)
    return out


def _cost(lens_rounded: torch.Tensor, mb: Sequence[int], mode: MicroBatchMode) -> int:
    sel = lens_rounded[list(mb)]
    return int(sel.sum()) if mode == "packed" else int(sel.max()) * len(mb)


def _split(
    mb: list[int], lens_rounded: torch.Tensor, mode: MicroBatchMode
) -> tuple[list[int], list[int]]:
    if mode == "padded":  # rows are sorted by length: halves keep each rectangle tight
        half = len(mb) // 2
        return mb[:half], mb[half:]
    a: list[int] = []
    b: list[int] = []
    load_a = load_b = 0
    for row in sorted(mb, key=lambda r: -int(lens_rounded[r])):
        if load_a <= load_b:
            a.append(row)
            load_a += int(lens_rounded[row])
        else:
            b.append(row)
            load_b += int(lens_rounded[row])
    return a, b


def split_to_count(
    lengths: Sequence[int] | torch.Tensor,
    micro_batches: Sequence[Sequence[int]],
    *,
    count: int,
    mode: MicroBatchMode,
    multiple: int = 1,
) -> list[list[int]]:
    """Split the costliest microbatches until there are exactly ``count`` of them.

    Used to give every data-parallel rank the same number of microbatches. The costliest
    microbatch with two or more rows (cost: packed tokens, or ``n_rows * padded length``) is cut
    in two (``"packed"``: token-balanced halves; ``"padded"``: the longer and the shorter half of
    its length-sorted rows); the second half goes right after the first. Splitting never makes a
    microbatch exceed the budget. ``ValueError`` when there are fewer rows than ``count`` or
    already more microbatches than ``count``.
    """
    lens = _rounded(as_lengths(lengths, name="lengths"), int(multiple))
    mbs = [list(mb) for mb in micro_batches]
    rows = sum(len(mb) for mb in mbs)
    if count < len(mbs):
        raise ValueError(f"split_to_count: {len(mbs)} microbatches already exceed count={count}")
    if rows < count:
        raise ValueError(f"split_to_count: {rows} rows cannot fill count={count} microbatches")
    per_mb = _reduce_per_mb(lens, mbs, mode)
    if mode == "padded":
        per_mb = per_mb * torch.tensor([len(mb) for mb in mbs], dtype=torch.int64)
    costs = per_mb.tolist()
    while len(mbs) < count:
        best = max((i for i in range(len(mbs)) if len(mbs[i]) > 1), key=lambda i: costs[i])
        first, second = _split(mbs[best], lens, mode)
        mbs[best : best + 1] = [first, second]
        costs[best : best + 1] = [_cost(lens, first, mode), _cost(lens, second, mode)]
    return mbs


def pack_into_count(
    lengths: Sequence[int] | torch.Tensor,
    *,
    count: int,
    max_tokens_per_microbatch: int,
    sequence_length_pad_multiple: int = 1,
) -> list[list[int]] | None:
    """Pack rows into exactly ``count`` token-balanced bins, or ``None`` if that breaks the budget.

    Longest-processing-time order: rows longest first (ties by index), each to the bin with the
    fewest tokens so far (ties: fewer rows, then lower index), so bins come out within about one
    row's length of each other. Used instead of :func:`split_to_count` when sequence packing
    must reach a bin count above first-fit-decreasing's: halving bins would leave some half
    empty, which unbalances ranks and wastes fixed-shape bins. ``None`` when a bin would exceed
    ``max_tokens_per_microbatch`` or stay empty (callers then fall back to splitting).
    """
    lens = as_lengths(lengths, name="lengths")
    if count < 1 or lens.numel() < count:
        return None
    costs = _rounded(lens, int(sequence_length_pad_multiple))
    order = torch.sort(lens, descending=True, stable=True).indices
    heap = [(0, 0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for row, cost in zip(order.tolist(), costs[order].tolist()):
        load, n_rows, b = heapq.heappop(heap)
        if load + cost > max_tokens_per_microbatch:
            return None
        bins[b].append(row)
        heapq.heappush(heap, (load + cost, n_rows + 1, b))
    return bins


def plan_microbatches(
    lengths: Sequence[int] | torch.Tensor,
    *,
    sequence_packing_args: Mapping[str, Any] | None = None,
    dynamic_batching_args: Mapping[str, Any] | None = None,
    count_multiple: int = 1,
) -> tuple[list[list[int]], list[int]]:
    """Plan microbatches for one (global) batch from exactly one of the two argument dicts.

    Returns ``(micro_batches, micro_batch_lengths)``: row-index lists into ``lengths`` and each
    microbatch's token length (``"packed"`` length under sequence packing, padded dim 1 under
    dynamic batching; see :func:`micro_batch_lengths`). The count is raised to a multiple of
    ``count_multiple``: packed rows are re-packed into that many balanced bins
    (:func:`pack_into_count`) when they fit, else (and for dynamic batches) the costliest
    microbatches are split (:func:`split_to_count`). Under ``microbatch_order="largest_first"`` the
    packed microbatches are sorted by length, longest first (stable); otherwise packer order.
    """
    if (sequence_packing_args is None) == (dynamic_batching_args is None):
        raise ValueError(
            "plan_microbatches needs exactly one of sequence_packing_args / dynamic_batching_args"
        )
    lens = as_lengths(lengths, name="lengths")
    if sequence_packing_args is not None:
        args = validate_sequence_packing_args(sequence_packing_args)
        mode: MicroBatchMode = "packed"
        multiple = args["sequence_length_pad_multiple"]
        mbs = plan_sequence_packing(
            lens,
            max_tokens_per_microbatch=args["max_tokens_per_microbatch"],
            sequence_length_pad_multiple=multiple,
            algorithm=args["algorithm"],
        )
    else:
        args = validate_dynamic_batching_args(dynamic_batching_args)  # type: ignore[arg-type]
        mode = "padded"
        multiple = args["sequence_length_round"]
        mbs = plan_dynamic_batches(
            lens,
            max_tokens_per_microbatch=args["max_tokens_per_microbatch"],
            sequence_length_round=multiple,
        )
    if count_multiple < 1:
        raise ValueError(f"count_multiple must be >= 1, got {count_multiple}")
    target = -(-len(mbs) // count_multiple) * count_multiple
    if target > len(mbs):
        repacked = None
        if mode == "packed":
            repacked = pack_into_count(
                lens,
                count=target,
                max_tokens_per_microbatch=args["max_tokens_per_microbatch"],
                sequence_length_pad_multiple=multiple,
            )
        mbs = repacked or split_to_count(lens, mbs, count=target, mode=mode, multiple=multiple)
    mbl = micro_batch_lengths(lens, mbs, mode=mode, multiple=multiple)
    if mode == "packed" and args["microbatch_order"] == "largest_first":
        order = sorted(range(len(mbs)), key=lambda i: -mbl[i])
        mbs = [mbs[i] for i in order]
        mbl = [mbl[i] for i in order]
    return mbs, mbl


def padded_token_fraction(
    lengths: Sequence[int] | torch.Tensor,
    micro_batches: Sequence[Sequence[int]],
    *,
    mode: MicroBatchMode,
    multiple: int = 1,
    pad_to: int | None = None,
) -> float:
    """Fraction of computed tokens that are padding, over all microbatches (0.0 when none).

    Computed tokens per microbatch: ``"packed"`` — its packed length
    (``sum(round_up(len_i, multiple))``), or ``pad_to`` when the packed row is padded to a fixed
    size (e.g. ``max_tokens_per_microbatch``); ``"padded"`` — ``n_rows * round_up(max len_i,
    multiple)``, or ``n_rows * pad_to`` when every row is padded to a fixed target (e.g. the
    step's ``global_forward_pad_seqlen``). Real tokens are ``sum(lengths[i])`` over the rows in
    the plan. ``pad_to`` smaller than what a microbatch needs is a ``ValueError``.
    """
    if mode not in ("packed", "padded"):
        raise ValueError(f"mode must be 'packed' or 'padded', got {mode!r}")
    lens = as_lengths(lengths, name="lengths")
    per_mb = _reduce_per_mb(_rounded(lens, int(multiple)), micro_batches, mode)
    sizes = torch.tensor([len(mb) for mb in micro_batches], dtype=torch.int64)
    if pad_to is not None:
        if per_mb.numel() and int(per_mb.max()) > pad_to:
            raise ValueError(
                f"pad_to={pad_to} is smaller than a microbatch's {int(per_mb.max())} tokens"
            )
        per_mb = torch.where(sizes > 0, int(pad_to), 0)
    computed = int((per_mb if mode == "packed" else per_mb * sizes).sum())
    rows = [i for mb in micro_batches for i in mb]
    real = int(lens[rows].sum()) if rows else 0
    return 0.0 if computed == 0 else (computed - real) / computed


def balanced_equal_count(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Split items into ``parts`` groups of equal size, balancing the groups' summed cost.

    ``len(costs)`` must be a multiple of ``parts``. Items go costliest first (ties by index) to
    the least-loaded group that still has room (ties: lowest group index). Returns the item
    indices of each group, ascending.
    """
    n = len(costs)
    if parts < 1 or n % parts:
        raise ValueError(f"balanced_equal_count: {n} items do not split into {parts} equal groups")
    per = n // parts
    order = torch.sort(
        torch.as_tensor(list(costs), dtype=torch.int64), descending=True, stable=True
    )
    heap = [(0, g) for g in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for item, cost in zip(order.indices.tolist(), order.values.tolist()):
        load, g = heapq.heappop(heap)
        groups[g].append(item)
        if len(groups[g]) < per:
            heapq.heappush(heap, (load + cost, g))
    for grp in groups:
        grp.sort()
    return groups
