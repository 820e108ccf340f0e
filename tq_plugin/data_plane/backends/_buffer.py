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
    """A validated one-row layout: which fields, in which order, how each is stored.

    Built by the full validation of the first such row; reused while ``epoch`` holds. A row
    matches it when every field has the plan's dtype and trailing dims: a jagged field's length
    (dim 1) may differ from row to row, a dense field's row shape may not.
    """

    epoch: int
    fields: tuple[tuple[str, ColumnSpec, tuple[int, ...], bool], ...]  # name, spec, tail, jagged
    dense_shapes: tuple[tuple[int, ...] | None, ...]  # a dense field's whole row shape (1, *tail)

    def unpack(self, rows: list[tuple[int, RowPlan, list[bytes], list[int], int]]) -> list[Prepared]:
        """Buffered rows back to one ``Prepared`` block per field: one join and one view per
        field (no torch dispatch per row)."""
        k = len(rows)
        out = []
        j = 0
        for i, (name, spec, tail, jagged) in enumerate(self.fields):
            data = b"".join([r[2][i] for r in rows])
            raw = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                   else torch.empty(0, dtype=torch.uint8))
            if jagged:
                lengths = np.fromiter((r[3][j] for r in rows), dtype=np.int64, count=k)
                j += 1
                out.append(Prepared(name, spec, raw.view(spec.dtype).reshape(-1, *tail), lengths, False))
            else:
                out.append(Prepared(name, spec, raw.view(spec.dtype).reshape(k, *tail), None, False))
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
        tensor, strided = torch.Tensor, torch.strided
        signature: list[Any] = []
        try:  # one pass: each field's layout key; a field no plan can take ends it at once
            for name, v in items:
                if (type(v) is not tensor or v.layout is not strided or not v.is_cpu
                        or v.requires_grad or not v.is_contiguous()):
                    return False
                signature += (name, v.dtype, v.dim())
        except (AttributeError, RuntimeError, NotImplementedError):
            return False
        key = tuple(signature)
        plan = part.plans.get(key)
        if plan is None or plan.epoch != part.epoch:
            plan = self._plan(part, items)
            if plan is None:
                return False
            if len(part.plans) > 64:
                part.plans.clear()
            part.plans[key] = plan
        # The one copy of the row: each field's bytes (contiguous CPU tensors only), once its
        # shape is checked against the plan; a row that does not fit takes the full path.
        chunks: list[bytes] = []
        lengths: list[int] = []
        nbytes = 0
        for (_, _, tail, jagged), dense, (_, v) in zip(plan.fields, plan.dense_shapes, items):
            shape = v.shape
            if jagged:
                if shape[0] != 1 or (tail and shape[2:] != tail):
                    return False
                lengths.append(shape[1])
            elif shape != dense:
                return False
            size = v.nbytes
            chunks.append(_string_at(v.data_ptr(), size))
            nbytes += size
        if part.num_samples is not None and len(part.slot_of) + 1 > part.num_samples:
            raise CapacityError(
                f"put_samples: partition {part.partition_id!r} holds {len(part.slot_of)} rows; "
                f"1 more would pass its num_samples={part.num_samples}"
            )
        if self._live_bytes + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"put_samples: {nbytes} bytes for partition {part.partition_id!r} would take "
                f"the store past capacity_bytes={self.capacity_bytes} ({self._live_bytes} held); "
                "clear consumed rows or raise capacity_bytes"
            )
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
        part.buffered.append((slot, plan, chunks, lengths, nbytes))
        self._live_bytes += nbytes
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
        fields = tuple(
            (name, p.spec, tuple(value.shape[2:] if p.spec.jagged else value.shape[1:]), p.spec.jagged)
            for (name, value), p in zip(items, prepared)
        )
        return RowPlan(part.epoch, fields, tuple(None if j else (1, *t) for _, _, t, j in fields))

    def _flush(self, part: Any) -> None:
        """Write the partition's buffered rows into its columns, one write per row layout.

        Rows of one layout go together whatever their order (each buffered id is new and
        appears once, so order between layouts cannot matter). An allocation failure leaves
        the rows not yet written buffered (acknowledged, never dropped) and raises.
        """
        groups: dict[int, list[tuple[int, RowPlan, list[bytes], list[int], int]]] = {}
        for row in part.buffered:
            groups.setdefault(id(row[1]), []).append(row)
        for run in groups.values():
            plan = run[0][1]
            k = len(run)
            slots = np.fromiter((r[0] for r in run), dtype=np.int64, count=k)
            prepared = plan.unpack(run)
            targets, grew = self._reserve(part, prepared, int(slots.max()) + 1)
            self._live_bytes += self._write(part, prepared, targets, slots) - sum(r[4] for r in run)
            written = {id(r) for r in run}
            part.buffered = [r for r in part.buffered if id(r) not in written]
            if grew:
                self._peak_bytes = max(self._peak_bytes, self._reserved_bytes())
