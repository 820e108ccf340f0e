"""Rows cut out of one flat values buffer: ``gather_rows`` joins ``values[start : start + length]``
for many rows at once. The embedded store's jagged columns, the Ray store's blocks and the
checkpoint writer all read rows this way."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

# Above this many separate storage runs in one read, one vectorized index gather beats a
# Python-level ``cat`` of per-run views.
_MAX_RUNS_FOR_CAT = 64


def numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view sharing ``t``'s memory, or None for dtypes numpy lacks (bfloat16)."""
    try:
        return t.numpy()
    except TypeError:
        return None


def gather_rows(
    values: torch.Tensor, starts: np.ndarray, lengths: np.ndarray, *, copy: bool = True
) -> torch.Tensor:
    """Concatenate ``values[starts[i] : starts[i] + lengths[i]]`` for every i.

    Rows that sit back to back in storage (the usual case: a read in put order) are one run:
    with ``copy=False`` that run comes back as a view of ``values`` (for append-only buffers,
    whose written bytes never change), else as a copy. A few runs are copied as runs. Scattered rows (a shuffled data-parallel shard) are joined from per-row views:
    numpy views when the dtype has one (~0.2 us a row, 3x faster than torch views), else one
    torch ``split`` of the region they span. The Python work is per row, never per token, and
    no per-token index tensor is built.
    """
    n = starts.shape[0]
    total = int(lengths.sum()) if n else 0
    if total == 0:
        return values.new_empty((0, *values.shape[1:]))
    ends = starts + lengths
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    if breaks.shape[0] < _MAX_RUNS_FOR_CAT:
        if breaks.shape[0] == 0:
            s = int(starts[0])
            run = values[s : s + total]
            return run.clone() if copy else run
        bounds = [0, *breaks.tolist(), n]
        return torch.cat(
            [values[int(starts[a]) : int(ends[b - 1])] for a, b in pairwise(bounds)]
        )
    flat = numpy_view(values)
    if flat is not None:
        rows = [flat[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
        return torch.from_numpy(np.concatenate(rows))
    order = np.argsort(starts, kind="stable")
    s_sorted, e_sorted = starts[order], ends[order]
    gaps = np.empty_like(s_sorted)
    gaps[0] = 0
    gaps[1:] = s_sorted[1:] - e_sorted[:-1]
    sizes = np.stack([gaps, lengths[order]], 1).ravel().tolist()
    region = values[int(s_sorted[0]) : int(e_sorted[-1])]
    rows_in_storage_order = region.split(sizes)[1::2]
    rank = np.empty_like(order)
    rank[order] = np.arange(n)
    return torch.cat([rows_in_storage_order[i] for i in rank.tolist()])
