"""The Ray store sharded: one metadata controller, the bytes on ``S`` storage units.

``RayDataPlane(num_storage_units=S)`` (``tq.backend.num_storage_units`` on ``tq/backend=ray``)
keeps the store's one actor (``ray_actor``) as the controller, and adds ``S`` storage-unit
actors that hold the bytes:

* **Metadata in one place.** Schema, validation, row ids and slots, tags, first-put order, claim
  cursors and the receipts (``KVBatchMeta``) stay in the controller, exactly as with one actor,
  so a claim never hands out a row twice and every put is checked against one schema.
* **Bytes on the storage units.** A put's field blocks of at least ``min_bytes`` go to the unit
  its first sample id hashes to (CRC-32 modulo ``S``; one-row puts, which staging makes, are
  hashed row by row): the unit copies them into Ray's object store, so it *owns* them, and
  answers with their references. The client then sends the controller the put with a
  ``StagedBlock`` (reference, shape) in place of each such block; the controller validates the
  put against shapes and dtypes (it never reads those bytes) and keeps the references. The copy
  of the bytes, the part of a put that grows with its size, runs in the unit's process, not the
  controller's. ``input_lengths`` (the controller reads its values to check per-token rows),
  one-element blocks and jagged blocks whose offsets do not span their values travel inline.
* **Reads gather from every unit at once.** The controller answers a read with references; the
  client fetches them all in one ``ray.get`` whichever units own them.
* **A clear is atomic across units**: only the controller's metadata says which rows exist, and
  it drops a cleared row's references under its lock; a unit's object is freed by Ray's
  reference counting once no row (and no reader) holds it.
* **Checkpoints cover every unit**: ``save`` runs in the controller, which reads every row's
  bytes through its references whichever unit owns them; ``restore`` puts the rows back through
  the controller (it then owns their blocks).

A put whose blocks are staged on a unit and then refused by the controller writes nothing: the
references die with the call and Ray frees the objects.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from tq_plugin.data_plane.backends.ray_cluster import import_ray
from tq_plugin.data_plane.backends.ray_columns import INLINE_BYTES, StagedBlock
from tq_plugin.data_plane.schema import INPUT_LENGTHS

_UNITS: dict[tuple[str, str], Any] = {}


class _StorageUnit:
    """A storage-unit actor: owns the Ray objects holding the blocks staged through it."""

    def stage(self, arrays: list[Any]) -> list[Any]:
        """Copy each array into Ray's object store (this process owns the object) and answer
        with the references: the arguments belong to the caller and die with it."""
        ray = import_ray()
        return [ray.put(a) for a in arrays]

    def pid(self) -> int:
        import os

        return os.getpid()


def checked_units(num_storage_units: Any) -> int:
    if isinstance(num_storage_units, bool) or not isinstance(num_storage_units, int):
        raise TypeError(f"RayDataPlane: num_storage_units must be an int, got {num_storage_units!r}")
    if num_storage_units < 1:
        raise ValueError(f"RayDataPlane: num_storage_units must be >= 1, got {num_storage_units}")
    return num_storage_units


def unit_of(sample_id: str, count: int) -> int:
    """The storage unit a sample id hashes to (stable across processes and runs)."""
    return zlib.crc32(sample_id.encode()) % count


def shipped(items: Sequence[tuple], min_bytes: int) -> list[int]:
    """Which of a payload's encoded fields (``name, kind, dtype, data, offsets``) a storage unit
    takes: blocks of ``min_bytes`` or more and two or more elements, but never
    ``input_lengths`` (the controller reads its values) nor a jagged block whose offsets do not
    run from 0 to its last value (its error must name the bytes the caller sent)."""
    out = []
    for i, (name, kind, _, data, offsets) in enumerate(items):
        if name == INPUT_LENGTHS or not hasattr(data, "nbytes"):
            continue
        if data.nbytes < min_bytes or data.size < 2:
            continue
        if kind == "dense" or (len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == data.shape[0]):
            out.append(i)
    return out


class StorageUnits:
    """The ``S`` storage-unit actors of one controller (named ``<actor_name>_unit<k>`` in its
    namespace), and the put-side step that stages blocks on them."""

    def __init__(self, actor_name: str, namespace: str, count: int, *, create: bool = True,
                 min_bytes: int = INLINE_BYTES, op_timeout_s: float = 300.0) -> None:
        ray = import_ray()
        self.count = checked_units(count)
        self.min_bytes = int(min_bytes)
        self.op_timeout_s = float(op_timeout_s)
        self.units = []
        for k in range(self.count):
            name = f"{actor_name}_unit{k}"
            handle = _UNITS.get((namespace, name))
            if handle is None:
                if create:
                    # num_cpus=0 like the controller: the units never take a worker's CPU slot.
                    handle = (ray.remote(_StorageUnit)
                              .options(name=name, namespace=namespace, num_cpus=0,
                                       max_concurrency=4, get_if_exists=True).remote())
                else:
                    handle = ray.get_actor(name, namespace=namespace)
                _UNITS[(namespace, name)] = handle
            self.units.append(handle)

    def _ships(self, name: str, kind: str, data: Any, offsets: Any) -> bool:
        if name == INPUT_LENGTHS or not hasattr(data, "nbytes"):
            return False
        if data.nbytes < self.min_bytes or data.size < 2:
            return False
        # A jagged block goes whole: its offsets must start at 0 and end at its last value.
        return kind == "dense" or (len(offsets) > 0 and offsets[0] == 0
                                   and offsets[-1] == data.shape[0])

    def stage(self, sample_ids: Any, payload: Any) -> Any:
        """``payload`` (``encode_fields``'s) with its large blocks staged on the storage unit
        the put's first sample id hashes to; anything the store will refuse travels as it is,
        so its error names it exactly as with one actor."""
        if (payload is None or payload[0] != "enc" or not isinstance(sample_ids, Sequence)
                or isinstance(sample_ids, str) or not sample_ids
                or not isinstance(sample_ids[0], str)):
            return payload
        _, batch, items = payload
        picked = shipped(items, self.min_bytes)
        if not picked:
            return payload
        unit = self.units[unit_of(sample_ids[0], self.count)]
        refs = import_ray().get(unit.stage.remote([items[i][3] for i in picked]),
                                timeout=self.op_timeout_s)
        items = list(items)
        for i, ref in zip(picked, refs):
            name, kind, dtype, data, offsets = items[i]
            items[i] = (name, kind, dtype, StagedBlock(ref, tuple(data.shape)), offsets)
        return ("enc", batch, items)

    def pids(self) -> list[int]:
        """The storage units' process ids (benchmarks read their CPU time)."""
        return import_ray().get([u.pid.remote() for u in self.units], timeout=self.op_timeout_s)


__all__ = ["StorageUnits", "checked_units", "shipped", "unit_of"]
