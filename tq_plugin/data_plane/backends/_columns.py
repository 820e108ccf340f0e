"""Column storage for the embedded backend: one growable buffer per field.

A *dense* column is a block ``[slot_capacity, *row_shape]`` indexed by row slot. A *jagged*
column is one contiguous values buffer ``[value_capacity, *trailing]`` plus a ``(start, length)``
pair per slot, so a read of many rows is one gather and comes back as a ``torch.jagged`` nested
tensor built straight from values + offsets. Overwritten or cleared rows leave garbage in the
values buffer; ``compact`` rewrites the live rows into a right-sized buffer.

These classes hold no lock and do no validation: ``LocalDataPlane`` validates a whole put before
calling them, under its lock, which is what makes a put atomic.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import numpy as np
import torch

# Above this many separate storage runs in one read, one vectorized index gather beats a
# Python-level ``cat`` of per-run views.
_MAX_RUNS_FOR_CAT = 64


class ColumnSpec(NamedTuple):
    """What a column holds: kind, dtype and the per-row (dense) or per-element (jagged) shape.

    A tuple, so the per-field check on every put is one cheap comparison.
    """

    jagged: bool
    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        kind = "jagged" if self.jagged else "dense"
        unit = "element" if self.jagged else "row"
        return f"{kind} {self.dtype} with {unit} shape {tuple(self.shape)}"


def _grow(buf: torch.Tensor, need: int) -> torch.Tensor:
    cap = buf.shape[0]
    if need <= cap:
        return buf
    new_cap = need if cap == 0 else max(need, 2 * cap)
    out = torch.empty((new_cap, *buf.shape[1:]), dtype=buf.dtype)
    out[:cap].copy_(buf)
    return out


def _numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view sharing ``t``'s memory, or None for dtypes numpy lacks (bfloat16)."""
    try:
        return t.numpy()
    except TypeError:
        return None


def gather_rows(values: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """Concatenate ``values[starts[i] : starts[i] + lengths[i]]`` for every i, as one new tensor.

    Rows that sit back to back in storage (the usual case: a read in put order) are copied as
    a few runs. Scattered rows (a shuffled data-parallel shard) are joined from per-row views:
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
            return values[s : s + total].clone()
        bounds = [0, *breaks.tolist(), n]
        return torch.cat(
            [values[int(starts[a]) : int(ends[b - 1])] for a, b in pairwise(bounds)]
        )
    flat = _numpy_view(values)
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


def _grow_array(arr: np.ndarray, capacity: int) -> np.ndarray:
    if capacity <= arr.shape[0]:
        return arr
    out = np.zeros(max(capacity, 2 * arr.shape[0]), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


class _Presence:
    """Per-slot bookkeeping lives in numpy: one-row puts (token staging) pay ~1 us per op
    instead of a torch dispatch, and bulk puts stay vectorized."""

    present: np.ndarray
    live_rows: int

    def has(self, slots: np.ndarray) -> np.ndarray:
        """Per requested slot: does this column hold a value for it?"""
        out = np.zeros(slots.shape[0], dtype=bool)
        inside = slots < self.present.shape[0]
        out[inside] = self.present[slots[inside]]
        return out


class DenseColumn(_Presence):
    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.data = torch.empty((0, *spec.shape), dtype=spec.dtype)
        # One-row writes go through numpy (~0.5 us) instead of a torch index-assign (~3 us).
        self._np = _numpy_view(self.data)
        self.present = np.zeros(0, dtype=bool)
        self.live_rows = 0

    def write(self, slots: np.ndarray, block: torch.Tensor, need: int) -> bool:
        """Write rows (``need`` = max slot + 1); True when a buffer was reallocated."""
        grew = need > self.data.shape[0]
        if grew:
            self.data = _grow(self.data, need)
            self._np = _numpy_view(self.data)
            self.present = _grow_array(self.present, self.data.shape[0])
        if slots.shape[0] == 1:  # one-row puts (token staging): plain scalar bookkeeping
            slot = int(slots[0])
            if not self.present[slot]:
                self.live_rows += 1
                self.present[slot] = True
            try:
                self._np[slot] = block.numpy()[0]  # type: ignore[index]
            except (TypeError, RuntimeError):  # no numpy view, or a tensor numpy refuses
                self.data[slot] = block[0]
            return grew
        self.live_rows += int(slots.shape[0] - np.count_nonzero(self.present[slots]))
        self.data.index_copy_(0, torch.from_numpy(slots), block)
        self.present[slots] = True
        return grew

    def read(self, slots: np.ndarray) -> torch.Tensor:
        return self.data.index_select(0, torch.from_numpy(slots))

    def drop(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.present.shape[0]]
        self.live_rows -= int(np.count_nonzero(self.present[slots]))
        self.present[slots] = False

    @property
    def live_bytes(self) -> int:
        row = self.data[0].numel() * self.data.element_size() if self.data.shape[0] else 0
        return self.live_rows * row

    @property
    def reserved_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class JaggedColumn(_Presence):
    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.values = torch.empty((0, *spec.shape), dtype=spec.dtype)
        self.used = 0
        self.garbage = 0
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.present = np.zeros(0, dtype=bool)
        self.live_rows = 0

    def _reserve_slots(self, capacity: int) -> None:
        if capacity > self.present.shape[0]:
            self.start = _grow_array(self.start, capacity)
            self.length = _grow_array(self.length, capacity)
            self.present = _grow_array(self.present, capacity)

    def _reserve_values(self, extra: int) -> bool:
        if self.used + extra <= self.values.shape[0]:
            return False
        if self.garbage:
            self.compact(extra)
        self.values = _grow(self.values, self.used + extra)
        return True

    def write(
        self, slots: np.ndarray, values: torch.Tensor, lengths: np.ndarray, need: int
    ) -> bool:
        """Append rows' values and point their slots at them (``need`` = max slot + 1).

        Returns True when a buffer was reallocated.
        """
        self._reserve_slots(need)
        was_present = self.present[slots]
        overwritten = int(np.count_nonzero(was_present))
        if overwritten:
            self.garbage += int(self.length[slots][was_present].sum())
            # Overwritten rows are absent during a possible compaction, so it never copies them.
            self.present[slots] = False
        self.live_rows += slots.shape[0] - overwritten
        total = values.shape[0]
        grew = self._reserve_values(total)
        base = self.used
        self.values[base : base + total].copy_(values)
        if slots.shape[0] == 1:
            self.start[slots] = base
        else:
            self.start[slots] = base + np.cumsum(lengths) - lengths
        self.length[slots] = lengths
        self.present[slots] = True
        self.used = base + total
        return grew

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.length[slots]
        values = gather_rows(self.values, self.start[slots], lengths)
        offsets = np.zeros(slots.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return values, torch.from_numpy(offsets)

    def drop(self, slots: np.ndarray) -> None:
        slots = slots[slots < self.present.shape[0]]
        mask = self.present[slots]
        self.garbage += int(self.length[slots][mask].sum())
        self.live_rows -= int(np.count_nonzero(mask))
        self.present[slots] = False
        if self.live_rows == 0:
            self.used = 0
            self.garbage = 0
        elif self.garbage > self.used - self.garbage:
            self.compact(0)

    def compact(self, extra: int) -> None:
        """Rewrite live rows, in storage order, into a buffer sized for them plus ``extra``."""
        live = np.flatnonzero(self.present)
        live = live[np.argsort(self.start[live], kind="stable")]
        lengths = self.length[live]
        packed = gather_rows(self.values, self.start[live], lengths)
        self.values = torch.empty((packed.shape[0] + extra, *self.spec.shape), dtype=self.spec.dtype)
        self.values[: packed.shape[0]].copy_(packed)
        self.start[live] = np.cumsum(lengths) - lengths
        self.used = packed.shape[0]
        self.garbage = 0

    @property
    def element_bytes(self) -> int:
        n = 1
        for d in self.spec.shape:
            n *= d
        return n * self.values.element_size()

    @property
    def live_bytes(self) -> int:
        return (self.used - self.garbage) * self.element_bytes

    @property
    def reserved_bytes(self) -> int:
        slots = self.present.shape[0] * (2 * 8 + 1)
        return self.values.shape[0] * self.element_bytes + slots
