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

from dataclasses import dataclass

import torch

# Above this many separate storage runs in one read, one vectorized index gather beats a
# Python-level ``cat`` of per-run views.
_MAX_RUNS_FOR_CAT = 64


@dataclass(frozen=True)
class ColumnSpec:
    """What a column holds: kind, dtype and the per-row (dense) or per-element (jagged) shape."""

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


def gather_rows(values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate ``values[starts[i] : starts[i] + lengths[i]]`` for every i, as one new tensor.

    Rows that sit back to back in storage (the usual case: a read in put order) are copied as
    a few runs. Scattered rows are cut out of the storage region they span with one ``split``
    (done in C++) and joined with one ``cat``: the only Python work is reordering the row
    views, never a per-token step, and no per-token index tensor is built.
    """
    n = starts.shape[0]
    total = int(lengths.sum()) if n else 0
    if total == 0:
        return values.new_empty((0, *values.shape[1:]))
    ends = starts + lengths
    breaks = torch.nonzero(starts[1:] != ends[:-1]).flatten() + 1
    if breaks.numel() < _MAX_RUNS_FOR_CAT:
        bounds = [0, *breaks.tolist(), n]
        if len(bounds) == 2:
            s = int(starts[0])
            return values[s : s + total].clone()
        return torch.cat(
            [values[int(starts[a]) : int(ends[b - 1])] for a, b in zip(bounds[:-1], bounds[1:])]
        )
    order = torch.argsort(starts)
    s_sorted, e_sorted = starts[order], ends[order]
    gaps = s_sorted.clone()
    gaps[1:] -= e_sorted[:-1]
    gaps[0] = 0
    sizes = torch.stack([gaps, lengths[order]], 1).flatten().tolist()
    region = values[int(s_sorted[0]) : int(e_sorted[-1])]
    rows_in_storage_order = region.split(sizes)[1::2]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n)
    return torch.cat([rows_in_storage_order[i] for i in rank.tolist()])


class _Presence:
    present: torch.Tensor

    def has(self, slots: torch.Tensor) -> torch.Tensor:
        """Per requested slot: does this column hold a value for it?"""
        inside = slots < self.present.shape[0]
        out = torch.zeros(slots.shape[0], dtype=torch.bool)
        out[inside] = self.present[slots[inside]]
        return out


class DenseColumn(_Presence):
    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.data = torch.empty((0, *spec.shape), dtype=spec.dtype)
        self.present = torch.zeros(0, dtype=torch.bool)
        self.live_rows = 0

    def reserve_slots(self, slot_capacity: int) -> None:
        self.data = _grow(self.data, slot_capacity)
        if self.present.shape[0] < slot_capacity:
            grown = torch.zeros(self.data.shape[0], dtype=torch.bool)
            grown[: self.present.shape[0]] = self.present
            self.present = grown

    def write(self, slots: torch.Tensor, block: torch.Tensor) -> None:
        self.reserve_slots(int(slots.max()) + 1)
        self.live_rows += int((~self.present[slots]).sum())
        self.data.index_copy_(0, slots, block)
        self.present[slots] = True

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.data.index_select(0, slots)

    def drop(self, slots: torch.Tensor) -> None:
        slots = slots[slots < self.present.shape[0]]
        self.live_rows -= int(self.present[slots].sum())
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
        self.start = torch.zeros(0, dtype=torch.int64)
        self.length = torch.zeros(0, dtype=torch.int64)
        self.present = torch.zeros(0, dtype=torch.bool)
        self.live_rows = 0

    def reserve_slots(self, slot_capacity: int) -> None:
        cap = self.present.shape[0]
        if slot_capacity <= cap:
            return
        new_cap = max(slot_capacity, 2 * cap)
        for name in ("start", "length", "present"):
            old = getattr(self, name)
            grown = torch.zeros(new_cap, dtype=old.dtype)
            grown[:cap] = old
            setattr(self, name, grown)

    def _reserve_values(self, extra: int) -> None:
        if self.used + extra <= self.values.shape[0]:
            return
        if self.garbage:
            self.compact(extra)
        self.values = _grow(self.values, self.used + extra)

    def write(self, slots: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self.reserve_slots(int(slots.max()) + 1)
        was_present = self.present[slots]
        self.garbage += int(self.length[slots][was_present].sum())
        self.live_rows += int((~was_present).sum())
        # Mark overwritten rows absent before a possible compaction, so it never copies them.
        self.present[slots] = False
        self._reserve_values(values.shape[0])
        base = self.used
        self.values[base : base + values.shape[0]].copy_(values)
        self.start[slots] = base + torch.cumsum(lengths, 0) - lengths
        self.length[slots] = lengths
        self.present[slots] = True
        self.used = base + values.shape[0]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.length.index_select(0, slots)
        values = gather_rows(self.values, self.start.index_select(0, slots), lengths)
        offsets = torch.zeros(slots.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return values, offsets

    def drop(self, slots: torch.Tensor) -> None:
        slots = slots[slots < self.present.shape[0]]
        mask = self.present[slots]
        self.garbage += int(self.length[slots][mask].sum())
        self.live_rows -= int(mask.sum())
        self.present[slots] = False
        if self.live_rows == 0:
            self.used = 0
            self.garbage = 0
        elif self.garbage > self.used - self.garbage:
            self.compact(0)

    def compact(self, extra: int) -> None:
        """Rewrite live rows, in storage order, into a buffer sized for them plus ``extra``."""
        live = torch.nonzero(self.present).flatten()
        starts = self.start[live]
        order = torch.argsort(starts)
        live, starts = live[order], starts[order]
        lengths = self.length[live]
        packed = gather_rows(self.values, starts, lengths)
        self.values = torch.empty((packed.shape[0] + extra, *self.spec.shape), dtype=self.spec.dtype)
        self.values[: packed.shape[0]].copy_(packed)
        self.start[live] = torch.cumsum(lengths, 0) - lengths
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
