"""``LocalDataPlane``: the embedded, in-process backend and the default.

Columnar: per partition and field, one contiguous buffer (see ``_columns``). A put runs in three
phases under the store's lock: validate everything (``_validate``), reserve every buffer it needs
(may allocate, never changes what the store holds), then write (allocates nothing). So every row
and every field of a put lands or none does, even when memory runs out part-way, and concurrent
puts and reads never see a half-written row.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from tq_plugin.data_plane.backends._buffer import RowBuffer
from tq_plugin.data_plane.backends._claims import TaskCursors
from tq_plugin.data_plane.backends._columns import POOL
from tq_plugin.data_plane.backends._journal import (
    SYNC_MODES,
    Journal,
    JournalError,
    checked_tags_for_journal,
    encode_fields,
)
from tq_plugin.data_plane.backends._journaled import Journaled
from tq_plugin.data_plane.backends._partition import (
    DEFAULT_CAPACITY_FRACTION,
    PUT_MODES,
    Partition,
    available_memory_bytes,
    checked_enums,
)
from tq_plugin.data_plane.backends._validate import (
    checked_tags,
    copy_tag,
    field_items,
    lengths_from,
    name_some,
    optional_count,
    prepare,
    str_list,
)
from tq_plugin.data_plane.backends._writes import WritePath
from tq_plugin.data_plane.calls import uniform_call
from tq_plugin.data_plane.checkpoint import PartitionSnapshot, load_into, save_store
from tq_plugin.data_plane.client import (
    DataPlaneClosedError,
    DataPlaneCorruptionError,
    FieldsLike,
)
from tq_plugin.data_plane.jagged import batch_of
from tq_plugin.data_plane.meta import KVBatchMeta


class LocalDataPlane(WritePath, RowBuffer, TaskCursors, Journaled):
    """Embedded keyed columnar store (implements ``DataPlaneClient``).

    Partitions must be registered before use. ``fields`` declares the names producers may write
    (an empty list leaves the schema open); ``jagged_fields`` names columns stored ragged per row
    even when a put hands them over dense. Any other field takes its kind from its first put and
    becomes jagged, losslessly, the first time a row of another length joins it.

    ``capacity_bytes`` bounds the live bytes the store holds (default: 40% of the memory
    available at construction); a put that would pass it raises ``CapacityError`` and writes
    nothing, instead of the process being killed for memory.

    ``journal_dir`` makes the store durable by acknowledgement: every register, put, clear and
    claim is appended to a journal there before the call returns, and a store opened on a
    directory that holds one first recovers every acknowledged call, byte-exact (``_journal``
    describes the format, the torn-tail rule and compaction). ``journal_sync``: ``"always"``
    (an fsync before each acknowledgement), ``"batch"`` (group commit: the call returns once an
    fsync covers its record, shared with concurrent writers) or ``"off"`` (written, not
    flushed: survives the process being killed, not the machine going down). The journal is
    compacted into a snapshot once ``journal_compact_bytes`` or ``journal_compact_records``
    have been appended since the last one, so recovery time stays bounded.
    """

    # put_samples refuses jagged per-token rows whose lengths differ from the rows' stored
    # input_lengths (column I/O then skips its own check read).
    checks_token_alignment = True
    supports_put_mode = True  # put_samples(mode="insert" | "update" | "upsert")
    claims_wait_in_store = True  # a blocking claim_meta sleeps on the store's condition

    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        journal_dir: str | os.PathLike[str] | None = None,
        journal_sync: str = "off",
        journal_compact_bytes: int = 256 << 20,
        journal_compact_records: int = 20_000,
    ) -> None:
        if capacity_bytes is None:
            capacity_bytes = int(DEFAULT_CAPACITY_FRACTION * available_memory_bytes())
        elif isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"LocalDataPlane: capacity_bytes must be an int, got {capacity_bytes!r}")
        elif capacity_bytes <= 0:
            raise ValueError(f"LocalDataPlane: capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.RLock()
        self._produced = threading.Condition(self._lock)  # notified by every put
        self._arrivals = 0
        self._partitions: dict[str, Partition] = {}
        self._closed = False
        self._live_bytes = 0
        self._peak_bytes = 0
        self._journal: Journal | None = None
        if journal_dir is not None:
            self._open_journal(journal_dir, journal_sync, journal_compact_bytes,
                               journal_compact_records)
        elif journal_sync not in SYNC_MODES:
            raise ValueError(f"LocalDataPlane: journal_sync must be one of {SYNC_MODES}, "
                             f"got {journal_sync!r}")

    # ------------------------------------------------------------------ lifecycle
    def _require_open(self) -> None:
        if self._closed:
            raise DataPlaneClosedError("LocalDataPlane is closed; create a new client")
        if self._journal is not None and self._journal.failed is not None:
            # fail-stop, reads too: the write that failed to journal landed in memory first,
            # and a caller that reads it back would take it for acknowledged, not durable
            self._journal.check_usable()

    def _partition(self, partition_id: str, *, flush: bool = True) -> Partition:
        """The partition (with its buffered one-row puts written, unless ``flush=False``)."""
        part = self._partitions.get(partition_id)
        if part is None:
            raise KeyError(
                f"unknown partition {partition_id!r}; call register_partition first "
                f"(registered: {sorted(self._partitions)})"
            )
        if flush and part.buffered:
            self._flush(part)
        return part

    def close(self) -> None:
        """Release every partition. Idempotent; any later operation raises."""
        with self._lock:
            self._partitions.clear()
            self._live_bytes = 0
            self._closed = True
            self._produced.notify_all()  # blocked claims wake up and raise
            journal, self._journal = self._journal, None
        if journal is not None:
            journal.close()
        POOL.clear()  # nothing waits for a later store call to hand freed maps back

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shared(self) -> bool:
        """False: the rows live in this process; other processes cannot reach them."""
        return False

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

        Re-registering never drops rows: it adds declared and jagged field names and consumer
        tasks. ``num_samples`` is a row limit (a put past it raises ``CapacityError``);
        ``grpo_group_size`` must divide it; ``enums`` (per-field string vocabularies) are
        checked and kept for NeMo RL parity. Every check runs before the schema changes, so a
        rejected call leaves the partition as it was.
        """
        where = "register_partition"
        if not isinstance(partition_id, str) or not partition_id:
            raise ValueError(f"{where}: partition_id must be a non-empty string, got {partition_id!r}")
        names = str_list(fields, where, "fields")
        jagged = str_list(jagged_fields or (), where, "jagged_fields")
        tasks = None if consumer_tasks is None else str_list(consumer_tasks, where, "consumer_tasks")
        num_samples = optional_count(num_samples, where, "num_samples")
        grpo_group_size = optional_count(grpo_group_size, where, "grpo_group_size")
        vocab = checked_enums(enums, where)
        with self._lock:
            self._require_open()
            if self._journal is not None:
                self._journal.check_usable()
            part = self._partitions.get(partition_id)
            if part is not None:
                self._flush(part)
                part.epoch += 1  # the schema may change: buffered-row plans lapse
            declared = set(part.declared) if part is not None else set()
            if names:
                # Closing an open schema keeps the fields it already holds writable.
                declared.update(names, part.columns if part is not None and not declared else ())
            for what, listed in (("jagged_fields", jagged), ("enums", list(vocab))):
                undeclared = [n for n in listed if declared and n not in declared]
                if undeclared:
                    raise ValueError(
                        f"{where}: {what} {name_some(undeclared)} are not among the declared "
                        f"fields of partition {partition_id!r}"
                    )
            for name in jagged:
                col = part.columns.get(name) if part is not None else None
                if col is not None and col.live_rows and not col.spec.jagged:
                    raise TypeError(
                        f"{where}: field {name!r} already holds dense rows; "
                        "it cannot be re-declared jagged while they are live"
                    )
            limit = num_samples if num_samples is not None else (part and part.num_samples)
            live = len(part.slot_of) if part is not None else 0
            if num_samples is not None and live > num_samples:
                raise ValueError(
                    f"{where}: num_samples={num_samples} is below the {live} rows partition "
                    f"{partition_id!r} already holds"
                )
            group = grpo_group_size or (part.grpo_group_size if part else None)
            if limit and group and limit % group:
                raise ValueError(
                    f"{where}: num_samples={limit} is not a multiple of grpo_group_size={group}"
                )
            if part is None:
                part = Partition(partition_id=partition_id, declared=set(), jagged=set())
                self._partitions[partition_id] = part
            part.declared = declared
            part.jagged.update(jagged)
            part.num_samples = limit or None
            part.grpo_group_size = group
            part.enums.update(vocab)
            if tasks:
                part.consumer_tasks = tuple(dict.fromkeys([*part.consumer_tasks, *tasks]))
            for task in part.consumer_tasks:
                if task not in part.consumed:
                    part.consumed[task] = set()
                    order = sorted(part.slot_of, key=lambda s: int(part.arrival[part.slot_of[s]]))
                    part.pending[task] = dict.fromkeys(order)
            ticket = self._log({"o": "reg", "p": partition_id, "f": names, "n": num_samples,
                                "c": tasks, "g": grpo_group_size, "e": vocab, "j": jagged})
        self._durable(ticket)

    # ------------------------------------------------------------------ writes
    @uniform_call
    def put_samples(
        self,
        *,
        partition_id: str,
        sample_ids: Sequence[str],
        fields: FieldsLike | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        mode: str = "upsert",
    ) -> KVBatchMeta:
        """Write ``fields`` (and ``tags``) for ``sample_ids``: all of it, or nothing.

        ``mode``: ``"upsert"`` writes new ids and overwrites existing ones; ``"insert"`` refuses
        (``ValueError``) ids the partition already holds; ``"update"`` refuses (``KeyError``) ids
        it does not hold, so a mistyped id never mints a row. Raises ``TypeError`` /
        ``ValueError`` for malformed input, ``KeyError`` for an unknown partition and
        ``CapacityError`` past ``num_samples`` or ``capacity_bytes``; nothing is written then.
        """
        where = "put_samples"
        ids = str_list(sample_ids, where, "sample_ids")
        if mode not in PUT_MODES:
            raise ValueError(f"{where}: mode must be one of {PUT_MODES}, got {mode!r}")
        n = len(ids)
        tag_rows = checked_tags(tags, n, where)
        items = field_items(fields, n)
        journal, encoded = self._journal, None
        if journal is not None and n:
            journal.check_usable()
            checked_tags_for_journal(tag_rows)
            try:
                encoded = encode_fields(items)
            except JournalError:
                raise
            except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
                # malformed: the put's own checks below name the problem
                encoded = None
        ticket = None
        with self._lock:
            self._require_open()
            part = self._partition(partition_id, flush=False)
            buffered = (
                n == 1
                and mode != "update"
                and items
                and ids[0] not in part.slot_of
                and self._buffer_one(part, ids[0], items, tag_rows)
            )
            if not buffered:
                if part.buffered:
                    self._flush(part)
                prepared = [prepare(part, name, value, n) for name, value in items]
                if n:
                    self._apply(part, ids, prepared, tag_rows, mode)
            if journal is not None and n:
                if encoded is None:  # the put passed the checks its encoding failed: never
                    journal.failed = JournalError("a put the journal could not encode landed")
                    journal.check_usable()
                ticket = self._log({"o": "put", "p": partition_id, "i": ids, "m": mode,
                                    "t": tag_rows, "f": encoded[0]}, encoded[1])
        self._durable(ticket)
        return KVBatchMeta.trusted(  # every part checked above
            partition_id=partition_id,
            task_name=None,
            sample_ids=ids,
            fields=[name for name, _ in items] or None,
            sequence_lengths=lengths_from(items),
            tags=None if tag_rows is None else [copy_tag(t) for t in tag_rows],
        )

    # ------------------------------------------------------------------ reads
    @uniform_call
    def get_samples(
        self, *, partition_id: str, sample_ids: Sequence[str], select_fields: Sequence[str]
    ) -> TensorDict:
        """Exactly the requested rows, in request order, as a ``TensorDict`` of batch ``[N]``.

        Jagged fields come back as ``torch.jagged`` nested tensors, dense fields dense. No later
        write ever changes what a read returned. Dense fields are fresh copies; jagged rows that
        sit back to back in the store (a read in put order) come back as a view of its
        append-only buffer, without a copy: treat them as read-only (``clone()`` before an
        in-place change). An in-place change to such a view would alter acknowledged rows; the
        store notices it and refuses further reads of that field (``DataPlaneCorruptionError``).
        Raises ``KeyError`` for unknown ids or a field some requested row lacks (never a short
        read).
        """
        ids = str_list(sample_ids, "get_samples", "sample_ids")
        names = str_list(select_fields, "get_samples", "select_fields")
        if not names:
            raise ValueError("get_samples: select_fields must name at least one field")
        out: dict[str, torch.Tensor] = {}
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            try:  # one pass; an unknown id (None) stops it
                slots = np.fromiter(map(part.slot_of.get, ids), dtype=np.int64, count=len(ids))
            except TypeError:
                missing = [s for s in ids if s not in part.slot_of]
                raise KeyError(
                    f"get_samples: {len(missing)} unknown sample_ids in partition "
                    f"{partition_id!r}: {name_some(missing)}"
                ) from None
            for name in names:
                col = part.columns.get(name)
                if col is None or (col.live_rows == 0 and ids):
                    raise KeyError(
                        f"get_samples: field {name!r} was never written to partition "
                        f"{partition_id!r} (or every row holding it was cleared)"
                    )
                # Every live row holds the field (the common case): no per-row check needed.
                have = None if col.live_rows == len(part.slot_of) else col.has(slots)
                if have is not None and not bool(have.all()):
                    lacking = [ids[i] for i in np.flatnonzero(~have).tolist()]
                    raise KeyError(
                        f"get_samples: field {name!r} not written for {len(lacking)} requested "
                        f"rows of partition {partition_id!r}: {name_some(lacking)}"
                    )
                if col.spec.jagged:
                    if not col.intact:  # type: ignore[union-attr]
                        raise DataPlaneCorruptionError(
                            f"get_samples: field {name!r} of partition {partition_id!r} was "
                            "modified in place through a tensor an earlier get_samples returned "
                            "(reads share the store's memory; clone() before changing them). "
                            "Its rows can no longer be trusted: clear and rewrite them."
                        )
                    values, offsets = col.read(slots)  # type: ignore[misc]
                    out[name] = torch.nested.nested_tensor_from_jagged(values, offsets)
                else:
                    out[name] = col.read(slots)  # type: ignore[assignment]
        return batch_of(out, len(ids))

    @uniform_call
    def get_tags(self, *, partition_id: str, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        """A copy of the tags stored for each id (empty dict when none), in request order."""
        ids = str_list(sample_ids, "get_tags", "sample_ids", unique=False)
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            missing = [s for s in ids if s not in part.slot_of]
            if missing:
                raise KeyError(f"get_tags: unknown sample_ids {name_some(missing)}")
            return [copy_tag(part.tags.get(s, {})) for s in ids]

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
    @uniform_call
    def clear_samples(self, *, partition_id: str, sample_ids: Sequence[str] | None = None) -> None:
        """Drop rows (idempotent: unknown ids are ignored). ``None`` drops the whole partition.

        Memory goes back as rows go: freed slots are reused, jagged buffers are compacted once
        garbage outweighs live data, and a column (or partition) with no rows left frees its
        buffers into the process's buffer pool (``_columns.BufferPool``): the next put of that
        size (the next step's) reuses them instead of faulting fresh pages in, and the pool
        hands them back to the OS once it is idle or over its bound.
        """
        ids = None if sample_ids is None else str_list(sample_ids, "clear_samples", "sample_ids", unique=False)
        with self._lock:
            self._require_open()
            if self._journal is not None:
                self._journal.check_usable()
            self._clear(partition_id, ids)
            ticket = self._log({"o": "clr", "p": partition_id, "i": ids})
        self._durable(ticket)

    def _clear(self, partition_id: str, ids: list[str] | None) -> None:
        """``clear_samples``' work, under the lock."""
        part = self._partitions.get(partition_id)
        if ids is None:
            if part is None or not part.slot_of:
                warnings.warn(
                    f"clear_samples(partition_id={partition_id!r}) found nothing to clear",
                    RuntimeWarning,
                    stacklevel=4,  # the caller of uniform_call's wrapper
                )
            if part is not None:
                self._live_bytes -= part.live_bytes + sum(r[4] for r in part.buffered)
                del self._partitions[partition_id]
                for col in part.columns.values():
                    col.release()  # its buffers go to the pool, for the next put to reuse
            return
        if part is None:
            return
        if part.buffered:
            self._flush(part)
        if (part.slot_of and len(ids) >= len(part.slot_of)
                and part.slot_of.keys() <= set(ids)):  # every row goes (a step's clear)
            part.slot_of.clear()
            part.tags.clear()
            for task in part.consumed:
                part.consumed[task] = set()
                part.pending[task] = {}
                part.pending_dead[task] = 0
            part.epoch += 1
            self._empty_out(part)
            return
        pop = part.slot_of.pop
        slots = [slot for slot in (pop(s, None) for s in ids) if slot is not None]
        if not slots:
            return
        if part.tags:
            for s in ids:
                part.tags.pop(s, None)
        for task, claimed in part.consumed.items():
            if claimed:
                claimed.difference_update(ids)
            part.drop_pending(task, ids)
        part.epoch += 1  # columns may empty out (and then change kind): plans lapse
        if not part.slot_of:
            self._empty_out(part)
            return
        part.free_slots.extend(slots)
        index = np.array(slots, dtype=np.int64)
        for col in part.columns.values():
            self._live_bytes += col.drop(index)

    def _empty_out(self, part: Partition) -> None:
        """The partition holds no row any more: free its columns, start its slots afresh."""
        self._live_bytes -= part.live_bytes
        for col in part.columns.values():
            col.release()
        part.free_slots.clear()
        part.next_slot = 0
        part.arrival = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ accounting
    def _reserved_bytes(self) -> int:
        return sum(c.reserved_bytes for p in self._partitions.values() for c in p.columns.values())

    def compactions(self) -> int:
        """How many times jagged buffers of live partitions were compacted (for tests/benchmarks)."""
        with self._lock:
            self._flush_all()
            return sum(
                getattr(c, "compactions", 0) for p in self._partitions.values() for c in p.columns.values()
            )

    def stats(self) -> dict[str, int]:
        """Rows held, bytes of live data, bytes reserved by buffers, the peak reserved, capacity."""
        with self._lock:
            self._flush_all()
            cols = [c for p in self._partitions.values() for c in p.columns.values()]
            return {
                "partitions": len(self._partitions),
                "rows": sum(len(p.slot_of) for p in self._partitions.values()),
                "live_bytes": sum(c.live_bytes for c in cols),
                "bytes_held": sum(c.reserved_bytes for c in cols),
                "peak_bytes_held": self._peak_bytes,
                "capacity_bytes": self.capacity_bytes,
                # freed large buffers kept for the next put's reuse until the pool is idle or
                # over its bound (process-wide; see trim())
                "bytes_cached": POOL.nbytes,
            }

    def trim(self) -> None:
        """Unmap the large buffers freed and kept for reuse now (they go back by themselves
        once the pool has been idle ``POOL.idle_s`` seconds, or at once past
        ``POOL.limit_bytes``)."""
        POOL.clear()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Checkpoint every partition (and JSON ``metadata``) to the directory ``path``.

        Atomic, no pickle; ``tq_plugin.data_plane.checkpoint`` describes the format.
        """
        save_store(self, path, metadata=metadata)  # copies under self._lock, writes outside it

    @classmethod
    def load(cls, path: str) -> LocalDataPlane:
        """A new store from a ``save`` checkpoint; rejects a truncated or modified one."""
        store = cls()
        try:
            load_into(store, path)
        except BaseException:
            store.close()
            raise
        return store

    def snapshot_partitions(self) -> list[PartitionSnapshot]:
        """A copy of every partition, for a checkpoint: taken under the lock (a consistent cut,
        no put half in it), buffered one-row puts included (they are acknowledged rows too)."""
        with self._lock:
            self._require_open()
            self._flush_all()
            return [p.snapshot() for _, p in sorted(self._partitions.items())]

    def restore_claims(self, partition_id: str, claimed: Mapping[str, list[str]]) -> None:
        """Mark rows claimed by tasks as ``claim_meta`` does (a checkpoint's claims coming back;
        the claim API cannot name the rows it hands out)."""
        with self._lock:
            part = self._partition(partition_id)
            if self._journal is not None:
                self._journal.check_usable()
            for task, ids in claimed.items():
                part.consumed.setdefault(task, set()).update(ids)
                pending = part.pending.get(task)
                if pending is not None:
                    for sid in ids:
                        pending.pop(sid, None)
            ticket = self._log({"o": "claim", "p": partition_id,
                                "c": {task: list(ids) for task, ids in claimed.items()}})
        self._durable(ticket)

