"""The embedded store's write path (mixed into ``LocalDataPlane``): check a validated put
against what the partition holds, reserve every buffer it needs, then write.

Reserving may allocate but never changes a row; writing allocates nothing but bookkeeping. So
a put that runs out of memory part-way leaves the store exactly as it was, and a put that
passed its checks always lands whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_plugin.data_plane.backends._columns import ColumnSpec, DenseColumn, JaggedColumn
from tq_plugin.data_plane.backends._validate import Prepared, check_token_alignment, name_some
from tq_plugin.data_plane.client import CapacityError


class WritePath:
    _live_bytes: int
    _peak_bytes: int
    _arrivals: int
    capacity_bytes: int
    _produced: Any
    _reserved_bytes: Any

    def _apply(
        self,
        part: Any,
        ids: list[str],
        prepared: list[Prepared],
        tag_rows: list[dict[str, Any]] | None,
        mode: str,
    ) -> None:
        """Check the put against what the partition holds, reserve, then write (under the lock)."""
        slot_of = part.slot_of
        found = list(map(slot_of.get, ids)) if slot_of else [None] * len(ids)
        if slot_of and None in found:
            new = [s for s, x in zip(ids, found) if x is None]
            if len(new) == len(ids):
                new = ids
        else:  # the common cases: every id is new (a step's first put) or every id is held
            new = [] if slot_of and found and found[0] is not None else ids
        if mode == "insert" and len(new) != len(ids):
            held = [s for s, x in zip(ids, found) if x is not None]
            raise ValueError(
                f"put_samples(mode='insert'): {len(held)} sample_ids already exist in partition "
                f"{part.partition_id!r}: {name_some(held)}"
            )
        if mode == "update" and new:
            raise KeyError(
                f"put_samples(mode='update'): {len(new)} sample_ids were never written to "
                f"partition {part.partition_id!r}: {name_some(new)}"
            )
        if part.num_samples is not None and len(part.slot_of) + len(new) > part.num_samples:
            raise CapacityError(
                f"put_samples: partition {part.partition_id!r} holds {len(part.slot_of)} rows; "
                f"{len(new)} more would pass its num_samples={part.num_samples}"
            )
        incoming = sum(p.block.numel() * p.block.element_size() for p in prepared)
        if self._live_bytes + incoming > self.capacity_bytes:
            raise CapacityError(
                f"put_samples: {incoming} bytes for partition {part.partition_id!r} would take "
                f"the store past capacity_bytes={self.capacity_bytes} ({self._live_bytes} held); "
                "clear consumed rows or raise capacity_bytes"
            )
        check_token_alignment(part, ids, found, prepared)
        # Slots for new ids, planned without touching the partition yet.
        reuse = min(len(new), len(part.free_slots))
        new_slots: Sequence[int] = (
            [*part.free_slots[len(part.free_slots) - reuse :],
             *range(part.next_slot, part.next_slot + len(new) - reuse)]
            if reuse else range(part.next_slot, part.next_slot + len(new))
        )
        if new is ids:  # every id is new: its slots, in order
            slots = (np.arange(part.next_slot, part.next_slot + len(ids), dtype=np.int64)
                     if not reuse else np.array(new_slots, dtype=np.int64))
        elif new:
            planned = dict(zip(new, new_slots))
            slots = np.array([planned[s] if x is None else x for s, x in zip(ids, found)], dtype=np.int64)
        else:
            slots = np.array(found, dtype=np.int64)
        need = int(slots.max()) + 1
        # Reserve: every allocation of the put happens here, and none changes visible rows.
        targets, grew = self._reserve(part, prepared, need)
        arrival = part.arrival
        if new and need > arrival.shape[0]:
            arrival = np.zeros(max(need, 2 * arrival.shape[0]), dtype=np.int64)
            arrival[: part.arrival.shape[0]] = part.arrival
        # Write: nothing below allocates more than bookkeeping, so it cannot fail part-way.
        if new:
            del part.free_slots[len(part.free_slots) - reuse :]
            part.next_slot += len(new) - reuse
            self._admit(part, new, new_slots, arrival, slots if new is ids else None)
        self._live_bytes += self._write(part, prepared, targets, slots)
        if tag_rows is not None:
            for sid, t in zip(ids, tag_rows):
                part.tags.setdefault(sid, {}).update(t)
        if grew:  # reserved bytes only rise when a buffer is reallocated
            self._peak_bytes = max(self._peak_bytes, self._reserved_bytes())
        self._produced.notify_all()

    def _reserve(
        self, part: Any, prepared: list[Prepared], need: int
    ) -> tuple[list[Any], bool]:
        """Every column the write needs, with room for it (may allocate; changes no row)."""
        grew = False
        targets: list[Any] = []
        for p in prepared:
            col = part.columns.get(p.name)
            if p.promote:
                col = col.to_jagged()  # type: ignore[union-attr]
            elif col is None or col.spec != p.spec:
                if col is not None and col.live_rows > 0:
                    # prepare() refuses a spec change on live rows; replacing the column here
                    # would drop acknowledged rows, so an escaped case fails loudly instead.
                    raise TypeError(
                        f"put_samples: field {p.name!r} holds {col.spec.describe()} in "
                        f"{col.live_rows} live rows; this put has {p.spec.describe()}"
                    )
                col = self._new_column(p.spec)
            grew = col.reserve(need, p.block.shape[0] if p.spec.jagged else 0) or grew
            targets.append(col)
        return targets, grew

    def _admit(self, part: Any, new: list[str], slots: Sequence[int], arrival: np.ndarray,
               index: np.ndarray | None = None) -> None:
        """Make ``new`` ids rows of the partition at ``slots`` (first-put order, claim queues);
        ``index`` is ``slots`` as an array when the caller has one."""
        part.slot_of.update(zip(new, slots))
        part.arrival = arrival
        if len(new) == 1:
            arrival[slots[0]] = self._arrivals
        else:
            arrival[np.array(slots, dtype=np.int64) if index is None else index] = np.arange(
                self._arrivals, self._arrivals + len(new))
        self._arrivals += len(new)
        for pending in part.pending.values():
            pending.update(dict.fromkeys(new))

    @staticmethod
    def _write(part: Any, prepared: list[Prepared], targets: list[Any], slots: np.ndarray) -> int:
        """Write reserved columns (allocates nothing); returns the change in live bytes."""
        delta = 0
        for p, col in zip(prepared, targets):
            if part.columns.get(p.name) is not col:
                part.columns[p.name] = col
                part.epoch += 1
            if p.spec.jagged:
                delta += col.write(slots, p.block, p.lengths)
            else:
                delta += col.write(slots, p.block)
        return delta

    def _new_column(self, spec: ColumnSpec) -> Any:
        """The column a field with no live rows gets (a hook for stores that keep bytes elsewhere).

        A column offers ``reserve(need_slots, extra_values) -> bool`` (may allocate, never
        changes what it holds), ``write(slots, block[, lengths]) -> live-bytes delta`` (allocates
        nothing), ``drop``, ``release``, ``has``, ``read``, ``to_jagged`` and byte counts.
        """
        return JaggedColumn(spec) if spec.jagged else DenseColumn(spec)
