"""``LocalDataPlane``: the embedded, in-process backend and the default.

Columnar: per partition and field, one contiguous buffer (see ``_columns``). A put is validated
in full before anything is written, then applied under the store's lock, so every row and every
field of a put lands or none does, and concurrent puts and reads never see a half-written row.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor

from tq_plugin.data_plane.backends._claims import TaskCursors
from tq_plugin.data_plane.backends._columns import ColumnSpec, DenseColumn, JaggedColumn
from tq_plugin.data_plane.client import DataPlaneClosedError, FieldsLike
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import INPUT_LENGTHS

_SHOW = 5  # how many offending ids an error message names


def _name_some(items: Sequence[Any]) -> str:
    shown = ", ".join(repr(x) for x in list(items)[:_SHOW])
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return f"[{shown}]{more}"


def _duplicates(ids: Sequence[str]) -> list[str]:
    if len(set(ids)) == len(ids):
        return []
    seen: set[str] = set()
    return list(dict.fromkeys(s for s in ids if s in seen or seen.add(s)))


@dataclass
class _Partition:
    partition_id: str
    declared: set[str]
    jagged: set[str]
    num_samples: int | None = None
    consumer_tasks: tuple[str, ...] = ()
    grpo_group_size: int | None = None
    enums: dict[str, list[str]] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    next_slot: int = 0
    columns: dict[str, DenseColumn | JaggedColumn] = field(default_factory=dict)
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)
    # first-put order per slot, for claims (a numpy array: no per-row Python work on puts)
    arrival: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    consumed: dict[str, set[str]] = field(default_factory=dict)  # task -> claimed ids


class _Prepared(NamedTuple):
    """One field of a put, validated and normalized, ready to write."""

    name: str
    spec: ColumnSpec
    block: torch.Tensor  # dense: [N, *shape]; jagged: values [total, *shape]
    lengths: np.ndarray | None  # jagged only: [N]


class LocalDataPlane(TaskCursors):
    """Embedded keyed columnar store (implements ``DataPlaneClient``).

    Partitions must be registered before use. ``fields`` declares the names producers may write
    (an empty list leaves the schema open); ``jagged_fields`` names columns stored ragged per row
    even when a put hands them over dense. Any other field takes its kind from its first put.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._produced = threading.Condition(self._lock)  # notified by every put
        self._arrivals = 0
        self._partitions: dict[str, _Partition] = {}
        self._closed = False
        self._peak_bytes = 0

    # ------------------------------------------------------------------ lifecycle
    def _require_open(self) -> None:
        if self._closed:
            raise DataPlaneClosedError("LocalDataPlane is closed; create a new client")

    def _partition(self, partition_id: str) -> _Partition:
        part = self._partitions.get(partition_id)
        if part is None:
            raise KeyError(
                f"unknown partition {partition_id!r}; call register_partition first "
                f"(registered: {sorted(self._partitions)})"
            )
        return part

    def close(self) -> None:
        """Release every partition. Idempotent; any later operation raises."""
        with self._lock:
            self._partitions.clear()
            self._closed = True
            self._produced.notify_all()  # blocked claims wake up and raise

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ schema
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int | None = None,
        consumer_tasks: Sequence[str] | None = None,
        grpo_group_size: int | None = None,
        enums: Mapping[str, Sequence[str]] | None = None,
        *,
        jagged_fields: Sequence[str] | None = None,
    ) -> None:
        """Declare a partition, or widen an existing one's schema (idempotent).

        Re-registering never drops rows: it adds declared and jagged field names. Every check
        runs before the schema changes, so a rejected call leaves the partition as it was.
        """
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError("register_partition: partition_id must be a non-empty string")
        names = list(fields)
        jagged = list(jagged_fields or ())
        if len(set(names)) != len(names):
            raise ValueError(f"register_partition: duplicate field names {_name_some(_duplicates(names))}")
        if num_samples is not None and num_samples <= 0:
            raise ValueError(f"register_partition: num_samples must be > 0, got {num_samples}")
        with self._lock:
            self._require_open()
            part = self._partitions.get(partition_id)
            declared = set(part.declared) if part is not None else set()
            if names:
                # Closing an open schema keeps the fields it already holds writable.
                declared.update(names, part.columns if part is not None and not declared else ())
            undeclared = [n for n in jagged if declared and n not in declared]
            if undeclared:
                raise ValueError(
                    f"register_partition: jagged_fields {_name_some(undeclared)} are not among "
                    f"the declared fields of partition {partition_id!r}"
                )
            for name in jagged:
                col = part.columns.get(name) if part is not None else None
                if col is not None and col.live_rows and not col.spec.jagged:
                    raise TypeError(
                        f"register_partition: field {name!r} already holds dense rows; "
                        "it cannot be re-declared jagged while they are live"
                    )
            if part is None:
                part = _Partition(partition_id=partition_id, declared=set(), jagged=set())
                self._partitions[partition_id] = part
            part.declared = declared
            part.jagged.update(jagged)
            part.num_samples = num_samples if num_samples is not None else part.num_samples
            part.consumer_tasks = tuple(consumer_tasks or part.consumer_tasks)
            for task in part.consumer_tasks:
                part.consumed.setdefault(task, set())
            part.grpo_group_size = grpo_group_size or part.grpo_group_size
            if enums:
                part.enums.update({k: list(v) for k, v in enums.items()})

    # ------------------------------------------------------------------ writes
    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """Write ``fields`` (and ``tags``) for ``sample_ids``: all of it, or nothing."""
        ids = list(sample_ids)
        n = len(ids)
        if not set(map(type, ids)) <= {str}:
            bad = [s for s in ids if not isinstance(s, str)]
            raise TypeError(f"put_samples: sample_ids must be strings, got {_name_some(bad)}")
        dups = _duplicates(ids)
        if dups:
            raise ValueError(f"put_samples: duplicate sample_ids in one put: {_name_some(dups)}")
        if tags is not None:
            tags = list(tags)
            if len(tags) != n:
                raise ValueError(f"put_samples: got {len(tags)} tags for {n} sample_ids")
            if not all(isinstance(t, Mapping) for t in tags):
                raise TypeError("put_samples: each tag must be a mapping of primitives")
        items = _field_items(fields, n)
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            prepared = [self._prepare(part, name, value, n) for name, value in items]
            if n:
                slots, new_slots = self._assign_slots(part, ids)
                need = int(slots.max()) + 1
                grew = False
                for p in prepared:
                    grew = self._write(part, p, slots, need) or grew
                if tags is not None:
                    for sid, t in zip(ids, tags):
                        part.tags.setdefault(sid, {}).update(t)
                if new_slots:
                    if need > part.arrival.shape[0]:
                        grown = np.zeros(max(need, 2 * part.arrival.shape[0]), dtype=np.int64)
                        grown[: part.arrival.shape[0]] = part.arrival
                        part.arrival = grown
                    count = len(new_slots)
                    part.arrival[new_slots] = np.arange(self._arrivals, self._arrivals + count)
                    self._arrivals += count
                if grew:  # reserved bytes only rise when a buffer is reallocated
                    self._peak_bytes = max(self._peak_bytes, self._reserved_bytes())
                self._produced.notify_all()
        names = [name for name, _ in items]
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=None,
            sample_ids=ids,
            fields=names or None,
            sequence_lengths=_lengths_from(items),
            tags=None if tags is None else [dict(t) for t in tags],
        )

    def _prepare(self, part: _Partition, name: str, value: torch.Tensor, n: int) -> _Prepared:
        """Validate one field of a put against the partition's schema and normalize it.

        Runs once per field of every put (24 fields for a staged call), so it reads each tensor
        attribute once and builds nothing it does not return.
        """
        if part.declared and name not in part.declared:
            raise ValueError(
                f"put_samples: field {name!r} is not declared for partition "
                f"{part.partition_id!r}; declared fields: {sorted(part.declared)}"
            )
        col = part.columns.get(name)
        live = col is not None and col.live_rows > 0
        if value.is_nested:
            return self._prepare_nested(part, name, value, n, col if live else None)
        shape = value.shape
        if not shape:
            raise ValueError(f"put_samples: field {name!r} is 0-d; every field needs a row dim")
        if shape[0] != n:
            raise ValueError(f"put_samples: field {name!r} has {shape[0]} rows for {n} sample_ids")
        if value.requires_grad:
            value = value.detach()
        if not value.is_cpu:
            value = value.cpu()
        jagged = col.spec.jagged if live else name in part.jagged  # type: ignore[union-attr]
        if jagged:
            if len(shape) < 2:
                raise ValueError(
                    f"put_samples: field {name!r} is jagged; a dense put needs shape "
                    f"[N, L, ...], got {tuple(shape)}"
                )
            spec = ColumnSpec(True, value.dtype, tuple(shape[2:]))
            block = value[0] if n == 1 else value.reshape(-1, *shape[2:])
            lengths = np.full(n, shape[1], dtype=np.int64)
        else:
            spec = ColumnSpec(False, value.dtype, tuple(shape[1:]))
            block, lengths = value, None
        if live and spec != col.spec:  # type: ignore[union-attr]
            _raise_mismatch(name, col.spec, spec)  # type: ignore[union-attr]
        return _Prepared(name, spec, block, lengths)

    def _prepare_nested(
        self, part: _Partition, name: str, value: torch.Tensor, n: int, live: Any
    ) -> _Prepared:
        if not isinstance(value, NestedTensor):
            raise TypeError(
                f"put_samples: field {name!r} must be a torch.jagged nested tensor "
                "(build it with torch.nested.nested_tensor_from_jagged), not a strided one"
            )
        # A jagged tensor's own methods are slow (each goes through __torch_function__), so
        # work on its values/offsets buffers directly.
        rows = value._offsets.shape[0] - 1
        if rows != n:
            raise ValueError(f"put_samples: field {name!r} has {rows} rows for {n} sample_ids")
        if value._ragged_idx != 1:
            raise TypeError(f"put_samples: field {name!r} must be ragged on dim 1")
        if live is not None and not live.spec.jagged:
            raise TypeError(
                f"put_samples: field {name!r} is stored dense ({live.spec.describe()}); "
                "got a jagged nested tensor"
            )
        if value._lengths is not None:
            value = value.contiguous()  # a narrowed view with holes
        block = value._values.detach()
        if not block.is_cpu:
            block = block.cpu()
        lengths = value._offsets.diff().cpu().numpy()
        spec = ColumnSpec(True, block.dtype, tuple(block.shape[1:]))
        if live is not None and spec != live.spec:
            _raise_mismatch(name, live.spec, spec)
        return _Prepared(name, spec, block, lengths)

    def _assign_slots(self, part: _Partition, ids: list[str]) -> tuple[np.ndarray, list[int]]:
        """Slots for ``ids`` (reusing freed ones), and the slots given to ids new to the partition."""
        lookup = part.slot_of.get
        slots = list(map(lookup, ids))
        new_slots: list[int] = []
        if None in slots:
            new = ids if slots.count(None) == len(ids) else [s for s, x in zip(ids, slots) if x is None]
            reuse = min(len(new), len(part.free_slots))
            fresh = range(part.next_slot, part.next_slot + len(new) - reuse)
            new_slots = [*part.free_slots[len(part.free_slots) - reuse :], *fresh]
            del part.free_slots[len(part.free_slots) - reuse :]
            part.next_slot += len(fresh)
            part.slot_of.update(zip(new, new_slots))
            slots = list(map(lookup, ids))
        return np.array(slots, dtype=np.int64), new_slots

    def _write(self, part: _Partition, p: _Prepared, slots: np.ndarray, need: int) -> bool:
        col = part.columns.get(p.name)
        if col is None or col.spec != p.spec:
            # No live rows (checked in _prepare): the column may change kind/dtype/shape.
            col = JaggedColumn(p.spec) if p.spec.jagged else DenseColumn(p.spec)
            part.columns[p.name] = col
        if p.spec.jagged:
            return col.write(slots, p.block, p.lengths, need)  # type: ignore[call-arg, arg-type]
        return col.write(slots, p.block, need)  # type: ignore[call-arg]

    # ------------------------------------------------------------------ reads
    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDict:
        """Exactly the requested rows, in request order, as a ``TensorDict`` of batch ``[N]``.

        Jagged fields come back as ``torch.jagged`` nested tensors, dense fields dense. Every
        returned tensor is a fresh copy, so callers may modify it freely.
        """
        ids = list(sample_ids)
        names = list(select_fields)
        if not names:
            raise ValueError("get_samples: select_fields must name at least one field")
        dups = _duplicates(ids)
        if dups:
            raise ValueError(f"get_samples: duplicate sample_ids requested: {_name_some(dups)}")
        if len(set(names)) != len(names):
            raise ValueError(f"get_samples: duplicate select_fields {_name_some(_duplicates(names))}")
        out: dict[str, torch.Tensor] = {}
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            found = list(map(part.slot_of.get, ids))
            if None in found:
                missing = [s for s, slot in zip(ids, found) if slot is None]
                raise KeyError(
                    f"get_samples: {len(missing)} unknown sample_ids in partition "
                    f"{partition_id!r}: {_name_some(missing)}"
                )
            slots = np.array(found, dtype=np.int64)
            for name in names:
                col = part.columns.get(name)
                if col is None:
                    raise KeyError(
                        f"get_samples: field {name!r} was never written to partition "
                        f"{partition_id!r}"
                    )
                # Every live row holds the field (the common case): no per-row check needed.
                have = None if col.live_rows == len(part.slot_of) else col.has(slots)
                if have is not None and not bool(have.all()):
                    lacking = [ids[i] for i in np.flatnonzero(~have).tolist()]
                    raise KeyError(
                        f"get_samples: field {name!r} not written for {len(lacking)} requested "
                        f"rows of partition {partition_id!r}: {_name_some(lacking)}"
                    )
                if col.spec.jagged:
                    values, offsets = col.read(slots)  # type: ignore[misc]
                    out[name] = torch.nested.nested_tensor_from_jagged(values, offsets)
                else:
                    out[name] = col.read(slots)  # type: ignore[assignment]
        return TensorDict(out, batch_size=[len(ids)])

    def get_tags(self, sample_ids: Sequence[str], partition_id: str) -> list[dict[str, Any]]:
        """The tags stored for each id (empty dict when none), in request order."""
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            missing = [s for s in sample_ids if s not in part.slot_of]
            if missing:
                raise KeyError(f"get_tags: unknown sample_ids {_name_some(missing)}")
            return [dict(part.tags.get(s, {})) for s in sample_ids]

    def list_sample_ids(self, partition_id: str) -> list[str]:
        """Sorted ids of the partition's live rows; ``[]`` for an unknown partition."""
        with self._lock:
            self._require_open()
            part = self._partitions.get(partition_id)
            return sorted(part.slot_of) if part else []

    def list_partitions(self) -> list[str]:
        with self._lock:
            self._require_open()
            return sorted(self._partitions)

    # ------------------------------------------------------------------ clears
    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        """Drop rows (idempotent: unknown ids are ignored). ``None`` drops the whole partition.

        Freed slots are reused and jagged buffers are compacted once garbage outweighs live
        data, so a long run that clears each step does not grow without bound.
        """
        with self._lock:
            self._require_open()
            part = self._partitions.get(partition_id)
            if sample_ids is None:
                if part is None or not part.slot_of:
                    warnings.warn(
                        f"clear_samples(None, {partition_id!r}) found nothing to clear",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                self._partitions.pop(partition_id, None)
                return
            if part is None:
                return
            pop = part.slot_of.pop
            slots = [slot for slot in (pop(s, None) for s in sample_ids) if slot is not None]
            if part.tags:
                for s in sample_ids:
                    part.tags.pop(s, None)
            for claimed in part.consumed.values():
                if claimed:
                    claimed.difference_update(sample_ids)
            if not slots:
                return
            part.free_slots.extend(slots)
            index = np.array(slots, dtype=np.int64)
            for col in part.columns.values():
                col.drop(index)

    # ------------------------------------------------------------------ accounting
    def _reserved_bytes(self) -> int:
        return sum(c.reserved_bytes for p in self._partitions.values() for c in p.columns.values())

    def stats(self) -> dict[str, int]:
        """Rows held, bytes of live data, bytes reserved by buffers, and the peak reserved."""
        with self._lock:
            cols = [c for p in self._partitions.values() for c in p.columns.values()]
            return {
                "partitions": len(self._partitions),
                "rows": sum(len(p.slot_of) for p in self._partitions.values()),
                "live_bytes": sum(c.live_bytes for c in cols),
                "bytes_held": sum(c.reserved_bytes for c in cols),
                "peak_bytes_held": self._peak_bytes,
            }

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Checkpoint every partition (and JSON ``metadata``) to the directory ``path``.

        Atomic, no pickle; ``_checkpoint`` describes the format.
        """
        from tq_plugin.data_plane.backends._checkpoint import save_store

        save_store(self, path, metadata=metadata)  # copies under self._lock, writes outside it

    @classmethod
    def load(cls, path: str) -> LocalDataPlane:
        """A new store from a ``save`` checkpoint; rejects a truncated or modified one."""
        from tq_plugin.data_plane.backends._checkpoint import load_store

        return load_store(path)


def _raise_mismatch(name: str, held: ColumnSpec, given: ColumnSpec) -> None:
    what = "dtype" if given.dtype != held.dtype else "shape"
    raise TypeError(
        f"put_samples: field {name!r} {what} mismatch: live rows hold {held.describe()}, "
        f"this put has {given.describe()}"
    )


def _field_items(fields: FieldsLike | None, n: int) -> list[tuple[str, torch.Tensor]]:
    """Flatten a put's payload to (name, tensor) pairs, rejecting what a column cannot hold."""
    if fields is None:
        return []
    if isinstance(fields, TensorDictBase):
        if tuple(fields.batch_size) != (n,):
            raise ValueError(
                f"put_samples: fields.batch_size is {tuple(fields.batch_size)}, expected ({n},)"
            )
        pairs = list(fields.items())
    elif isinstance(fields, Mapping):
        pairs = list(fields.items())
    else:
        raise TypeError(
            f"put_samples: fields must be a TensorDict or a mapping of tensors, got {type(fields).__name__}"
        )
    for name, value in pairs:
        if not isinstance(name, str):
            raise TypeError(f"put_samples: field names must be strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            kind = type(value).__name__
            raise TypeError(
                f"put_samples: field {name!r} is a non-tensor leaf ({kind}); only tensors "
                "(dense or torch.jagged nested) are stored. Put primitives in tags."
            )
    return pairs


def _lengths_from(items: list[tuple[str, torch.Tensor]]) -> list[int] | None:
    for name, value in items:
        if name == INPUT_LENGTHS and not value.is_nested and value.dim() == 1:
            return [int(x) for x in value.tolist()]
    return None
