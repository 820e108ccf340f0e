"""Column storage for the embedded backend: one growable buffer per field.

A *dense* column is a block ``[slot_capacity, *row_shape]`` indexed by row slot. A *jagged*
column is one contiguous values buffer ``[value_capacity, *trailing]`` plus a ``(start, length)``
pair per slot, so a read of many rows is one gather and comes back as a ``torch.jagged`` nested
tensor built straight from values + offsets. Overwritten or cleared rows leave garbage in the
values buffer; ``compact`` rewrites the live rows into a new buffer once garbage outweighs them.

These classes hold no lock and do no validation: ``LocalDataPlane`` validates a whole put before
calling them, under its lock. Writing is two-phase, which is what makes a put atomic even when
memory runs out: ``reserve`` may allocate but never changes what a column holds, and ``write``
allocates nothing, so it cannot fail part-way.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from tq_plugin.data_plane.rows import gather_rows, numpy_view


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


# Buffers at least this large live in anonymous memory maps: dropping one hands its pages back
# to the OS at once, whichever thread allocated it (glibc keeps freed heap memory in per-thread
# arenas, so a multi-threaded producer's RSS would otherwise stay at its peak after a clear).
_MMAP_MIN_BYTES = 1 << 20


_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    """Large freed buffers kept for the next allocation that fits them, across steps.

    A fresh anonymous map costs a page fault per 4 KiB on first touch (9 ms for 13 MB here,
    20x the copy itself), so a put that follows a clear (each step's partition) would pay it
    every step. A freed buffer nobody else references (no read still holds a view of it) waits
    here and is handed to the next allocation of its size (``take``), however long the step
    between them took. A buffer a read still holds views of waits too, but is handed out only
    once those views are gone, so no reader ever sees its bytes change.

    Memory goes back to the OS only when the pool is idle or over its bound:

    * idle: nothing was taken or given back for ``idle_s`` seconds (a background timer thread,
      alive only while the pool holds buffers, unmaps them all);
    * over the bound: past ``limit_bytes`` in all, the oldest buffers are unmapped at once.

    ``LocalDataPlane.trim()`` empties the pool at once; ``released`` counts buffers unmapped
    by either rule (tests, benchmarks).
    """

    def __init__(self, limit_bytes: int = 256 << 20, idle_s: float = 30.0) -> None:
        self.limit_bytes = limit_bytes
        self.idle_s = idle_s
        self.released = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._entries: list[tuple[int, torch.Tensor]] = []  # size, flat uint8; oldest first
        self._nbytes = 0
        self._last_used = 0.0
        self._reaper: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 buffer of at least ``nbytes`` (and at most twice that) that no read
        still holds a view of, or None."""
        with self._lock:
            self._last_used = time.monotonic()
            best = -1
            for i, (size, flat) in enumerate(self._entries):
                if nbytes <= size <= 2 * nbytes and (best < 0 or size < self._entries[best][0]) \
                        and self._unshared(flat):
                    best = i
            if best < 0:
                return None
            size, flat = self._entries.pop(best)
            self._nbytes -= size
            return flat

    @staticmethod
    def _unshared(flat: torch.Tensor) -> bool:
        # Users of the storage: the pool's own tensor, plus this query's handle. Anything more
        # is a tensor someone else holds (a read's view).
        return _use_count(flat.untyped_storage()._cdata) <= 2

    def give(self, t: torch.Tensor) -> None:
        """Keep ``t``'s storage (a large map) for reuse once no read holds a view of it."""
        if _use_count is None or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        size = storage.nbytes()
        if size < _MMAP_MIN_BYTES or size > self.limit_bytes:
            return
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        with self._lock:
            self._last_used = time.monotonic()
            self._entries.append((size, flat))
            self._nbytes += size
            while self._nbytes > self.limit_bytes:  # over the bound: the oldest go back now
                gone, _ = self._entries.pop(0)
                self._nbytes -= gone
                self.released += 1
            if self._entries and self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="tq-buffer-pool",
                                                daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        """Unmap everything once the pool has been idle ``idle_s`` seconds; exit when empty
        (``give`` starts another when buffers come back)."""
        with self._lock:
            try:
                while self._entries:
                    wait = self._last_used + self.idle_s - time.monotonic()
                    if wait <= 0:
                        self.released += len(self._entries)
                        self._entries.clear()
                        self._nbytes = 0
                        break
                    self._wake.wait(wait)
            finally:
                self._reaper = None

    def clear(self) -> None:
        """Unmap every buffer now (a buffer a read still holds goes when the read lets go)."""
        with self._lock:
            self._entries.clear()
            self._nbytes = 0
            self._wake.notify_all()

    def _after_fork(self) -> None:
        # A forked child has no reaper thread and may have inherited a held lock.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reaper = None


POOL = BufferPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=POOL._after_fork)


def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; large ones are backed by their own anonymous mmap (or by a
    recently freed one from ``POOL``)."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _MMAP_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    reused = POOL.take(nbytes)
    if reused is not None:
        return reused[:nbytes].view(dtype).view(shape)
    # torch.frombuffer keeps the map alive exactly as long as a tensor uses it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _grown(buf: torch.Tensor, need: int) -> torch.Tensor:
    """``buf`` itself when it holds ``need`` rows, else a copy with geometric headroom."""
    cap = buf.shape[0]
    if need <= cap:
        return buf
    out = alloc((need if cap == 0 else max(need, 2 * cap), *buf.shape[1:]), buf.dtype)
    out[:cap].copy_(buf)
    return out


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


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@functools.cache
def dtype_support(dtype: torch.dtype) -> tuple[bool, bool]:
    """``(storable, index_copy)``: can a column hold this dtype (element copies work), and can
    it scatter rows natively (else rows move through a same-size integer view)?"""
    a, b = torch.zeros(2, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    try:
        a, b = torch.zeros(2, dtype=dtype), torch.zeros(1, dtype=dtype)
        a[:1].copy_(b)
    except (RuntimeError, TypeError, NotImplementedError):
        return False, False
    try:
        a.index_copy_(0, torch.zeros(1, dtype=torch.int64), b)
    except (RuntimeError, TypeError, NotImplementedError):
        return True, False
    return True, True


def _scatter_rows(data: torch.Tensor, index: torch.Tensor, block: torch.Tensor) -> None:
    """``data[index] = block`` row-wise, for every storable dtype (float8, uint16, ...)."""
    if not dtype_support(data.dtype)[1]:
        as_int = _SAME_SIZE_INT[data.element_size()]
        data, block = data.view(as_int), block.view(as_int)
    data.index_copy_(0, index, block)


def _empty(spec: ColumnSpec) -> torch.Tensor:
    return torch.empty((0, *spec.shape), dtype=spec.dtype)


class DenseColumn(_Presence):
    """A block ``[slot_capacity, *row_shape]``; a row's slot is its index."""

    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.data = _empty(spec)
        # One-row writes go through numpy (~0.5 us) instead of a torch index-assign (~3 us).
        self._np = numpy_view(self.data)
        self.present = np.zeros(0, dtype=bool)
        self.live_rows = 0
        self.row_bytes = _numel(spec.shape) * self.data.element_size()

    def reserve(self, need_slots: int, extra_values: int = 0) -> bool:
        """Make room for slots ``< need_slots``; content-preserving. True when it reallocated."""
        if need_slots <= self.data.shape[0]:
            return False
        data = _grown(self.data, need_slots)
        present = _grow_array(self.present, data.shape[0])
        old, self._np = self.data, None
        self.data, self._np, self.present = data, numpy_view(data), present
        POOL.give(old)
        return True

    def write(self, slots: np.ndarray, block: torch.Tensor) -> int:
        """Write rows into reserved slots; returns the change in live bytes. Allocates nothing."""
        if slots.shape[0] == 1:  # one-row puts (token staging): plain scalar bookkeeping
            slot = int(slots[0])
            added = 0
            if not self.present[slot]:
                self.live_rows += 1
                self.present[slot] = True
                added = 1
            try:
                self._np[slot] = block.numpy()[0]  # type: ignore[index]
            except (TypeError, RuntimeError):  # no numpy view, or a tensor numpy refuses
                self.data[slot] = block[0]
            return added * self.row_bytes
        added = int(slots.shape[0] - np.count_nonzero(self.present[slots]))
        self.live_rows += added
        _scatter_rows(self.data, torch.from_numpy(slots), block)
        self.present[slots] = True
        return added * self.row_bytes

    def read(self, slots: np.ndarray) -> torch.Tensor:
        return self.data.index_select(0, torch.from_numpy(slots))

    def drop(self, slots: np.ndarray) -> int:
        """Forget rows; returns the (negative) change in live bytes. The last one frees the block."""
        slots = slots[slots < self.present.shape[0]]
        gone = int(np.count_nonzero(self.present[slots]))
        self.live_rows -= gone
        self.present[slots] = False
        if self.live_rows == 0:
            self.release()
        return -gone * self.row_bytes

    def release(self) -> None:
        """Forget every row and free the block."""
        self.live_rows = 0
        old, self._np = self.data, None
        self.data = _empty(self.spec)
        self._np = numpy_view(self.data)
        self.present = np.zeros(0, dtype=bool)
        POOL.give(old)

    def to_jagged(self) -> JaggedColumn:
        """The same rows as a jagged column (row ``[L, *t]`` becomes L elements of shape t)."""
        spec = ColumnSpec(True, self.spec.dtype, tuple(self.spec.shape[1:]))
        col = JaggedColumn(spec)
        live = np.flatnonzero(self.present)
        length = self.spec.shape[0]
        col.reserve(self.present.shape[0], live.shape[0] * length)
        if live.shape[0]:
            block = self.read(live).reshape(-1, *spec.shape)
            col.write(live, block, np.full(live.shape[0], length, dtype=np.int64))
        return col

    @property
    def live_bytes(self) -> int:
        return self.live_rows * self.row_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.data.shape[0] * self.row_bytes + self.present.shape[0]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class JaggedColumn(_Presence):
    """One values buffer ``[capacity, *element_shape]`` plus a ``(start, length)`` per slot.

    The buffer is append-only: a written element is never written again (an overwrite appends,
    compaction and growth move rows into a new buffer). So a read of rows that sit back to back
    is handed out as a view, with no copy, and no later write can change it under the reader.
    A reader that modifies such a view in place would change acknowledged rows; torch's version
    counter (shared by a view and its base) tells, and ``intact`` reports it.

    Overwrites and clears leave garbage behind; it is compacted away only once it outweighs the
    live data, so the copy a compaction makes is paid for by at least as many garbage elements
    and a write's amortized cost does not grow with the column.
    """

    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.values = _empty(spec)
        self.used = 0
        self.garbage = 0
        self.compactions = 0
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.present = np.zeros(0, dtype=bool)
        self.live_rows = 0
        self.element_bytes = _numel(spec.shape) * self.values.element_size()
        self._version = self.values._version  # the buffer's version after our own last write
        self._poisoned = False

    @property
    def intact(self) -> bool:
        """False once someone modified the buffer in place through a view handed out by a read."""
        return not self._poisoned and self.values._version == self._version

    def _note_foreign_writes(self) -> None:
        # Called before each of our own writes, which move the version on.
        if self.values._version != self._version:
            self._poisoned = True

    def _adopt(self, values: torch.Tensor) -> None:
        self._note_foreign_writes()
        old, self.values = self.values, values
        self._version = values._version
        POOL.give(old)

    def reserve(self, need_slots: int, extra_values: int) -> bool:
        """Room for slots ``< need_slots`` and ``extra_values`` more elements; content-preserving.

        Either every buffer is ready or (on an allocation failure) nothing visible changed.
        True when a buffer was reallocated.
        """
        grew = False
        if need_slots > self.present.shape[0]:
            start = _grow_array(self.start, need_slots)
            length = _grow_array(self.length, need_slots)
            present = _grow_array(self.present, need_slots)
            self.start, self.length, self.present = start, length, present
            grew = True
        if self.used + extra_values <= self.values.shape[0]:
            return grew
        if self.garbage and self.garbage >= self.used - self.garbage:
            self.compact(extra_values)
        if self.used + extra_values > self.values.shape[0]:
            self._adopt(_grown(self.values, self.used + extra_values))
        return True

    def write(self, slots: np.ndarray, values: torch.Tensor, lengths: np.ndarray) -> int:
        """Append rows' values into reserved room and point their slots at them.

        Returns the change in live bytes. Allocates nothing, so it cannot fail part-way.
        """
        was_present = self.present[slots]
        overwritten = int(np.count_nonzero(was_present))
        old = 0
        if overwritten:
            old = int(self.length[slots][was_present].sum())
            self.garbage += old
        self.live_rows += slots.shape[0] - overwritten
        total = values.shape[0]
        base = self.used
        self._note_foreign_writes()
        self.values[base : base + total].copy_(values)
        self._version = self.values._version
        if slots.shape[0] == 1:
            self.start[slots] = base
        else:
            self.start[slots] = base + np.cumsum(lengths) - lengths
        self.length[slots] = lengths
        self.present[slots] = True
        self.used = base + total
        return (total - old) * self.element_bytes

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.length[slots]
        values = gather_rows(self.values, self.start[slots], lengths, copy=False)
        offsets = np.zeros(slots.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return values, torch.from_numpy(offsets)

    def drop(self, slots: np.ndarray) -> int:
        """Forget rows; returns the (negative) change in live bytes. Memory goes back as it goes."""
        slots = slots[slots < self.present.shape[0]]
        mask = self.present[slots]
        gone = int(self.length[slots][mask].sum())
        self.garbage += gone
        self.live_rows -= int(np.count_nonzero(mask))
        self.present[slots] = False
        if self.live_rows == 0:
            self.release()
        elif self.garbage > self.used - self.garbage:
            self.compact(0)
        return -gone * self.element_bytes

    def release(self) -> None:
        """Forget every row and free the buffers."""
        self.live_rows = 0
        self._adopt(_empty(self.spec))
        self._poisoned = False  # every row is gone, and with them what was changed
        self.used = self.garbage = 0
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.present = np.zeros(0, dtype=bool)

    def compact(self, extra: int) -> None:
        """Rewrite live rows, in storage order, into a new buffer with room for ``extra`` more.

        The new buffer keeps geometric headroom (up to twice what it must hold, never more than
        the old capacity), so a stream of overwrites does not compact on every write.
        """
        live = np.flatnonzero(self.present)
        live = live[np.argsort(self.start[live], kind="stable")]
        lengths = self.length[live]
        packed = gather_rows(self.values, self.start[live], lengths)
        size = packed.shape[0]
        cap = max(size + extra, min(2 * (size + extra), self.values.shape[0]))
        values = alloc((cap, *self.spec.shape), self.spec.dtype)
        values[:size].copy_(packed)
        self._adopt(values)
        self.start[live] = np.cumsum(lengths) - lengths
        self.used = size
        self.garbage = 0
        self.compactions += 1

    @property
    def live_bytes(self) -> int:
        return (self.used - self.garbage) * self.element_bytes

    @property
    def reserved_bytes(self) -> int:
        slots = self.present.shape[0] * (2 * 8 + 1)
        return self.values.shape[0] * self.element_bytes + slots
