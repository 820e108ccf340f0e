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
import heapq
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from tq_plugin.config.schema import MICROBATCH_ORDERS, PACKING_ALGORITHMS

MicroBatchMode = Literal["packed", "padded"]

# "first_fit_decreasing": plain FFD. "modified_first_fit_decreasing": Johnson and Garey's MFFD
# (size classes; large rows first get medium rows and pairs of small rows, then FFD), the
# algorithm NeMo RL's exemplar configs name.
# Defined once, in the torch-free config schema (the layer below this one).
SEQUENCE_PACKING_ALGORITHMS = PACKING_ALGORITHMS

_SEQPACK_KEYS = frozenset(
    {
        "algorithm",
        "input_key",
        "input_lengths_key",
        "sequence_length_pad_multiple",
        "max_tokens_per_microbatch",
        "microbatch_order",
    }
)
_DYNBATCH_KEYS = frozenset(
    {"input_key", "input_lengths_key", "sequence_length_round", "max_tokens_per_microbatch"}
)


# ---------------------------------------------------------------------------- validation
def as_lengths(
    lengths: Sequence[int] | torch.Tensor, *, name: str = "sequence_lengths"
) -> torch.Tensor:
    """``lengths`` as a 1-D int64 CPU tensor.

    ``TypeError`` when the entries are not integers (floats, bools, strings, nested tensors);
    ``ValueError`` for a shape other than 1-D, an int beyond int64, or a negative length.
    """
    if isinstance(lengths, torch.Tensor) and lengths.is_nested:
        raise TypeError(f"{name} must be a dense 1-D integer tensor, got a nested tensor")
    if isinstance(lengths, (list, tuple)):
        kinds = set(map(type, lengths))
        if not kinds <= {int} and not all(
            issubclass(k, numbers.Integral) and k is not bool for k in kinds
        ):
            bad = sorted(
                k.__name__ for k in kinds if k is bool or not issubclass(k, numbers.Integral)
            )
            raise TypeError(f"{name} must hold ints, got {bad}")
    elif isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    try:
        t = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as exc:  # ints beyond int64, odd array types
        raise ValueError(f"{name} must be a sequence of non-negative int64 values: {exc}") from None
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{name} must hold ints, got dtype {t.dtype}")
    t = t.to(device="cpu", dtype=torch.int64)
    if t.numel() and int(t.min()) < 0:
        bad = int(torch.nonzero(t < 0)[0, 0])
        raise ValueError(f"{name} must be non-negative: row {bad} has length {int(t[bad])}")
    return t


def _positive_int(args: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in args:
        if default is None:
            raise ValueError(f"{where}[{key!r}] is required")
        return default
    value = args[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}[{key!r}] must be a positive int, got {type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"{where}[{key!r}] must be a positive int, got {value!r}")
    return int(value)


def _check_keys(args: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(args, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(args).__name__}")
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def validate_sequence_packing_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of ``sequence_packing_args`` with defaults filled in.

    ``max_tokens_per_microbatch`` is required (a positive int); ``sequence_length_pad_multiple``
    defaults to 1, ``algorithm`` to ``"first_fit_decreasing"``, ``microbatch_order`` to
    ``"packer"``. Unknown keys are an error (they are usually typos). ``TypeError`` for a
    non-dict or a non-int count; ``ValueError`` for a missing, unknown or out-of-range value.
    """
    where = "sequence_packing_args"
    _check_keys(args, _SEQPACK_KEYS, where)
    out = dict(args)
    out["max_tokens_per_microbatch"] = _positive_int(args, "max_tokens_per_microbatch", where)
    out["sequence_length_pad_multiple"] = _positive_int(
        args, "sequence_length_pad_multiple", where, default=1
    )
    algorithm = args.get("algorithm", "first_fit_decreasing")
    if algorithm not in SEQUENCE_PACKING_ALGORITHMS:
        raise ValueError(
            f"{where}['algorithm'] = {algorithm!r} is not supported; "
            f"use one of {list(SEQUENCE_PACKING_ALGORITHMS)}"
        )
    out["algorithm"] = algorithm
    order = args.get("microbatch_order", "packer")
    if order not in MICROBATCH_ORDERS:
        raise ValueError(
            f"{where}['microbatch_order'] = {order!r}; use one of {list(MICROBATCH_ORDERS)}"
        )
    out["microbatch_order"] = order
    return out


def validate_dynamic_batching_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of ``dynamic_batching_args``: ``max_tokens_per_microbatch`` required (> 0),
    ``sequence_length_round`` defaults to 1. Unknown keys are an error."""
    where = "dynamic_batching_args"
    _check_keys(args, _DYNBATCH_KEYS, where)
    out = dict(args)
    out["max_tokens_per_microbatch"] = _positive_int(args, "max_tokens_per_microbatch", where)
    out["sequence_length_round"] = _positive_int(args, "sequence_length_round", where, default=1)
    return out


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
