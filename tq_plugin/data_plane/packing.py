"""Microbatch planners: sequence packing and dynamic batching, on row lengths only.

Both planners take the rows' valid token lengths and return a *plan*: a list of microbatches,
each a list of row indices into ``lengths``. They never look at tensors' contents and never
truncate a row; a row that cannot fit a microbatch on its own is a ``ValueError``.

Two microbatch shapes, named by ``mode`` throughout this module:

* ``"packed"`` (sequence packing): a microbatch is one packed row holding its sequences back to
  back, each padded to ``sequence_length_pad_multiple``. Its length is
  ``sum(round_up(len_i, sequence_length_pad_multiple))`` and never exceeds
  ``max_tokens_per_microbatch``.
* ``"padded"`` (dynamic batching): a microbatch is an ``[n_rows, L]`` rectangle with
  ``L = round_up(max len_i, sequence_length_round)`` and
  ``n_rows * L <= max_tokens_per_microbatch``.

Errors, everywhere in this module: ``TypeError`` for lengths that are not integers or an
argument of the wrong type (a budget given as ``"512"``, an args dict that is not a dict);
``ValueError`` for a negative length, a row over the budget, or an out-of-range argument. Each
message names the argument.

The argument dicts match NeMo RL's policy plumbing (names and keys):
``sequence_packing_args = {algorithm, input_key, input_lengths_key, sequence_length_pad_multiple,
max_tokens_per_microbatch, [microbatch_order]}`` and ``dynamic_batching_args = {input_key,
input_lengths_key, sequence_length_round, max_tokens_per_microbatch}``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Literal

import torch

from tq_plugin.data_plane.packing_args import (
    SEQUENCE_PACKING_ALGORITHMS,
    as_lengths,
)

MicroBatchMode = Literal["packed", "padded"]

def _rounded(lengths: torch.Tensor, multiple: int) -> torch.Tensor:
    if multiple <= 1:
        return lengths.clone()
    return (lengths + (multiple - 1)) // multiple * multiple


def _prepare(
    lengths: Sequence[int] | torch.Tensor, budget: int, multiple_name: str, multiple: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Checked planner inputs: ``(row order longest first, rounded lengths)``, or ``None``."""
    lens = as_lengths(lengths, name="lengths")
    if budget < 1 or int(multiple) < 1:
        raise ValueError(
            f"max_tokens_per_microbatch and {multiple_name} must be positive, got "
            f"{budget} and {multiple}"
        )
    if lens.numel() == 0:
        return None
    rounded = _rounded(lens, int(multiple))
    if int(rounded.max()) > budget:
        row = int(torch.argmax(rounded))
        raise ValueError(
            f"row {row} has {int(lens[row])} tokens ({int(rounded[row])} after rounding to "
            f"{multiple_name}={multiple}), more than max_tokens_per_microbatch={budget}; rows are "
            "never truncated: raise max_tokens_per_microbatch"
        )
    return torch.sort(lens, descending=True, stable=True).indices, rounded


# ---------------------------------------------------------------------------- planners
def _first_fit(
    rows: Sequence[int], costs: Sequence[int], cap: int, bins: list[list[int]], free: list[int]
) -> list[list[int]]:
    """First fit of ``rows`` (in the given order) after the already-open ``bins``.

    ``free[b]`` is the room left in open bin ``b``. The leftmost bin with room is found in
    O(log n) per row with a max-segment-tree over the bins' free space (unopened bins sit to the
    right with full capacity, so the leftmost fitting leaf is the answer whether or not it is
    open yet). Appends to ``bins`` in place and returns it.
    """
    size = 1
    while size < len(bins) + len(rows):
        size *= 2
    tree = [cap] * (2 * size)  # tree[1] root; leaves tree[size + b] = room left in bin b
    for b, room in enumerate(free):
        tree[size + b] = room
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    for row, cost in zip(rows, costs):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= cost else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(row)
        tree[node] -= cost
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def _modified_first_fit(order: list[int], costs: list[int], cap: int) -> list[list[int]]:
    """Johnson and Garey's modified first fit decreasing over rows sorted longest first.

    Rows are classed by cost: large (> cap/2), medium (> cap/3), small (> cap/6), tiny.
    1. Each large row opens its own bin (longest first).
    2. Forward through the large bins: each takes the longest remaining medium row that fits.
    3. Backward through the large bins that took no medium row: when the two shortest remaining
       small rows fit together, the bin takes the shortest, then the longest small row that
       still fits.
    4. The remaining rows, longest first, go by first fit over all bins (large bins first).
    Steps 2-3 fill each large bin's gap with the rows that fit it best, which plain FFD leaves to
    whichever row comes next in length order.
    """
    large = [k for k, c in enumerate(costs) if 2 * c > cap]
    medium = [k for k, c in enumerate(costs) if 3 * c > cap >= 2 * c]
    small = [k for k, c in enumerate(costs) if 6 * c > cap >= 3 * c]
    bins = [[order[k]] for k in large]
    free = [cap - costs[k] for k in large]
    used: set[int] = set()

    # Remaining rows of one class, ascending by (cost, -rank): the entry just below a bisect at
    # (room, inf) is the longest that fits, the earliest in length order among equals.
    def pool(ks: list[int]) -> list[tuple[int, int]]:
        return sorted((costs[k], -k) for k in ks)

    mediums = pool(medium)
    got_medium = [False] * len(bins)
    for b in range(len(bins)):
        at = bisect.bisect_right(mediums, (free[b], 0)) - 1
        if at >= 0:
            cost, neg = mediums.pop(at)
            bins[b].append(order[-neg])
            free[b] -= cost
            used.add(-neg)
            got_medium[b] = True
    smalls = pool(small)
    for b in reversed(range(len(bins))):
        if got_medium[b] or len(smalls) < 2 or smalls[0][0] + smalls[1][0] > free[b]:
            continue
        shortest = smalls.pop(0)
        # the (old) second shortest still fits, so the bisect finds a row
        longest_fit = smalls.pop(bisect.bisect_right(smalls, (free[b] - shortest[0], 0)) - 1)
        for cost, neg in (shortest, longest_fit):
            bins[b].append(order[-neg])
            free[b] -= cost
            used.add(-neg)
    rest = [k for k in range(len(order)) if k not in used and 2 * costs[k] <= cap]
    return _first_fit([order[k] for k in rest], [costs[k] for k in rest], cap, bins, free)


def plan_sequence_packing(
    lengths: Sequence[int] | torch.Tensor,
    *,
    max_tokens_per_microbatch: int,
    sequence_length_pad_multiple: int = 1,
    algorithm: str = "first_fit_decreasing",
) -> list[list[int]]:
    """Bin packing of rows into packed microbatches, by ``algorithm``.

    Each row costs ``round_up(lengths[i], sequence_length_pad_multiple)`` tokens; a bin holds at
    most ``max_tokens_per_microbatch``. ``"first_fit_decreasing"``: rows are taken longest first
    (ties by index) and each goes to the first open bin with room; bins in the order they were
    opened, rows in each bin in the order they were placed (longest first).
    ``"modified_first_fit_decreasing"``: see :func:`_modified_first_fit`; bins holding a long
    row (over half the budget) come first. Every row appears exactly once; ``[]`` for no rows.
    ``ValueError`` for a row whose cost exceeds the budget, or an unknown algorithm.
    """
    if algorithm not in SEQUENCE_PACKING_ALGORITHMS:
        raise ValueError(
            f"algorithm {algorithm!r} is not supported; use one of {list(SEQUENCE_PACKING_ALGORITHMS)}"
        )
    cap = int(max_tokens_per_microbatch)
    prepared = _prepare(lengths, cap, "sequence_length_pad_multiple", sequence_length_pad_multiple)
    if prepared is None:
        return []
    order_t, costs = prepared
    order = order_t.tolist()
    sorted_costs = costs[order_t].tolist()
    if algorithm == "modified_first_fit_decreasing":
        return _modified_first_fit(order, sorted_costs, cap)
    return _first_fit(order, sorted_costs, cap, [], [])


def plan_dynamic_batches(
    lengths: Sequence[int] | torch.Tensor,
    *,
    max_tokens_per_microbatch: int,
    sequence_length_round: int = 1,
) -> list[list[int]]:
    """Token-budget microbatches of similar-length rows.

    Rows are sorted longest first (ties by index); each microbatch takes consecutive rows while
    ``n_rows * round_up(longest_len, sequence_length_round) <= max_tokens_per_microbatch``. The
    first row of a microbatch is its longest, so each microbatch takes
    ``max_tokens_per_microbatch // round_up(first_len)`` rows (one Python step per microbatch).
    Returns one list of row indices (into ``lengths``) per microbatch, longest microbatch rows
    first. A row whose rounded length exceeds the budget raises ``ValueError``.
    """
    budget = int(max_tokens_per_microbatch)
    prepared = _prepare(lengths, budget, "sequence_length_round", sequence_length_round)
    if prepared is None:
        return []
    order, rounded = prepared
    n = rounded.numel()
    lead = rounded[order]
    # rows allowed in a microbatch that row i leads (all the rest when it has length 0)
    take = torch.where(lead > 0, budget // lead.clamp(min=1), n).tolist()
    order_list = order.tolist()
    batches: list[list[int]] = []
    start = 0
    while start < n:
        stop = min(n, start + take[start])
        batches.append(order_list[start:stop])
        start = stop
    return batches


# ---------------------------------------------------------------------------- plan helpers
