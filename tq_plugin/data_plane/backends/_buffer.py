"""The one-row write buffer of the embedded store (mixed into ``LocalDataPlane``).

Token staging puts one row of ~24 small fields per model call. Validating and writing each
field into its column costs more than the bytes themselves, so a one-row put of a new id whose
row layout was validated before (a ``RowPlan``) is acknowledged by packing the row's bytes (one
copy) into the partition's buffer. Anything that looks at columns (reads, claims, clears,
stats, checkpoints, schema changes, any other put) first writes the buffered rows, a run of one
layout at a time, as one multi-row write. A buffered row is an acknowledged row: readable at
once, counted in capacity and ``num_samples``, and kept if a flush runs out of memory.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import numpy as np
import torch

from tq_plugin.data_plane.backends._columns import ColumnSpec
from tq_plugin.data_plane.backends._validate import Prepared, prepare
from tq_plugin.data_plane.client import CapacityError
from tq_plugin.data_plane.schema import TOKEN_ALIGNED_FIELDS

_string_at = ctypes.string_at


class RowPlan(NamedTuple):
    """A validated one-row layout: which fields, how each is stored, where its bytes sit in the
    packed row. Built by the full validation of the first such row; reused while ``epoch`` holds."""

    epoch: int
    fields: tuple[tuple[str, ColumnSpec, tuple[int, ...], int, int], ...]  # name, spec, shape, start, stop
    nbytes: int
    order: tuple[int, ...]  # the put's fields in packing order (widest elements first: aligned)

    def unpack(self, rows: list[bytes]) -> list[Prepared]:
        """Packed rows back to one ``Prepared`` block per field (numpy slices: single-threaded
        small copies, no torch dispatch per row)."""
        k = len(rows)
        flat = np.frombuffer(bytearray(b"".join(rows)), dtype=np.uint8).reshape(k, self.nbytes)
        out = []
        for name, spec, shape, start, stop in self.fields:
            raw = torch.from_numpy(np.ascontiguousarray(flat[:, start:stop]).reshape(-1))
            block = raw.view(spec.dtype).reshape(k, *shape)
            if spec.jagged:
                out.append(Prepared(name, spec, block.reshape(-1, *spec.shape),
                                    np.full(k, shape[0], dtype=np.int64), False))
            else:
                out.append(Prepared(name, spec, block, None, False))
        return out


class RowBuffer:
    """Buffering of one-row puts; ``LocalDataPlane`` provides the state and write primitives."""

    _partitions: dict[str, Any]
    _live_bytes: int
    _peak_bytes: int
    capacity_bytes: int
    _produced: Any
    _reserve: Any
    _write: Any
    _admit: Any
    _reserved_bytes: Any

    def _flush_all(self) -> None:
        for part in self._partitions.values():
            if part.buffered:
                self._flush(part)

    _FLUSH_ROWS = 64

    def _buffer_one(
        self, part: Any, sid: str, items: list[tuple[str, torch.Tensor]],
        tag_rows: list[dict[str, Any]] | None,
    ) -> bool:
        """Acknowledge a one-row put of a new id by packing it into the partition's buffer.

        Only for a row layout validated before (a ``RowPlan``), into live columns of the same
        kind; anything else (first row of a layout, a field that must turn jagged, a per-token
        column, non-CPU or grad tensors) returns False and takes the full path. The row is
        copied here, so the caller may reuse its tensors; reads write buffered rows first.
        """
        try:
            key = tuple((name, v.dtype, v.shape, v.layout, v.is_cpu, v.requires_grad,
                         v.is_contiguous()) for name, v in items if type(v) is torch.Tensor)
        except (AttributeError, RuntimeError, NotImplementedError):
            return False
        if len(key) != len(items):
            return False
        plan = part.plans.get(key)
        if plan is None or plan.epoch != part.epoch:
            plan = self._plan(part, items)
            if plan is None:
                return False
            if len(part.plans) > 64:
                part.plans.clear()
            part.plans[key] = plan
        if part.num_samples is not None and len(part.slot_of) + 1 > part.num_samples:
            raise CapacityError(
                f"put_samples: partition {part.partition_id!r} holds {len(part.slot_of)} rows; "
                f"1 more would pass its num_samples={part.num_samples}"
            )
        if self._live_bytes + plan.nbytes > self.capacity_bytes:
            raise CapacityError(
                f"put_samples: {plan.nbytes} bytes for partition {part.partition_id!r} would take "
                f"the store past capacity_bytes={self.capacity_bytes} ({self._live_bytes} held); "
                "clear consumed rows or raise capacity_bytes"
            )
        # The one copy of the row: its bytes, field after field (contiguous CPU tensors only).
        tensors = [items[i][1] for i in plan.order]
        packed = b"".join([_string_at(t.data_ptr(), t.nbytes) for t in tensors])
        slot = part.free_slots.pop() if part.free_slots else part.next_slot
        if slot == part.next_slot:
            part.next_slot += 1
        arrival = part.arrival
        if slot >= arrival.shape[0]:
            arrival = np.zeros(max(slot + 1, 2 * arrival.shape[0]), dtype=np.int64)
            arrival[: part.arrival.shape[0]] = part.arrival
        self._admit(part, [sid], [slot], arrival)
        if tag_rows is not None:
            part.tags.setdefault(sid, {}).update(tag_rows[0])
        part.buffered.append((slot, plan, packed))
        self._live_bytes += plan.nbytes
        if len(part.buffered) >= self._FLUSH_ROWS:
            self._flush(part)
        self._produced.notify_all()
        return True

    def _plan(self, part: Any, items: list[tuple[str, torch.Tensor]]) -> RowPlan | None:
        """Validate a one-row layout in full; a plan when its rows can be buffered, else None."""
        prepared = [prepare(part, name, value, 1) for name, value in items]  # raises on bad input
        for (name, value), p in zip(items, prepared):
            col = part.columns.get(name)
            if (p.promote or col is None or not col.live_rows or col.spec != p.spec
                    or not value.is_cpu or value.requires_grad or not value.is_contiguous()
                    or (p.spec.jagged and name in TOKEN_ALIGNED_FIELDS)):
                return None
        # Widest elements first, so every field starts aligned for its dtype in the packed row.
        order = sorted(range(len(items)), key=lambda i: -items[i][1].element_size())
        fields = []
        start = 0
        for i in order:
            name, value = items[i]
            stop = start + value.numel() * value.element_size()
            fields.append((name, prepared[i].spec, tuple(value.shape[1:]), start, stop))
            start = stop
        return RowPlan(part.epoch, tuple(fields), start, tuple(order))

    def _flush(self, part: Any) -> None:
        """Write the partition's buffered rows into its columns, one write per row layout.

        Rows of one layout go together whatever their order (each buffered id is new and
        appears once, so order between layouts cannot matter). An allocation failure leaves
        the rows not yet written buffered (acknowledged, never dropped) and raises.
        """
        groups: dict[int, list[tuple[int, RowPlan, bytes]]] = {}
        for row in part.buffered:
            groups.setdefault(id(row[1]), []).append(row)
        for run in groups.values():
            plan = run[0][1]
            k = len(run)
            slots = np.fromiter((r[0] for r in run), dtype=np.int64, count=k)
            prepared = plan.unpack([r[2] for r in run])
            targets, grew = self._reserve(part, prepared, int(slots.max()) + 1)
            self._live_bytes += self._write(part, prepared, targets, slots) - k * plan.nbytes
            written = {id(r) for r in run}
            part.buffered = [r for r in part.buffered if id(r) not in written]
            if grew:
                self._peak_bytes = max(self._peak_bytes, self._reserved_bytes())
