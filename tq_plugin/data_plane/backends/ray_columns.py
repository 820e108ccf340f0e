"""The Ray store's bytes: how a put's fields travel, and the columns that hold them in Ray.

* ``encode_fields`` / ``decode_fields``: a put's payload as numpy buffers (Ray ships them out of
  band, and the actor maps them zero-copy from shared memory); ``as_numpy`` / ``as_torch`` the
  zero-copy views both ends use (dtypes numpy lacks travel as same-size unsigned ints).
* ``RefColumn``: the column interface ``LocalDataPlane`` drives, over blocks the store actor
  owns (``stage_block``: a Ray object, or an inline copy under ``INLINE_BYTES``); reads answer
  with locations, and the client fetches (``fetch_blocks``) and gathers (``gather_blocks``).

``ray_actor`` (the store actor and its client) is the only user. Ray is imported only when a
block is put or fetched.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor

from tq_plugin.data_plane.backends._columns import ColumnSpec
from tq_plugin.data_plane.backends._validate import check_storable
from tq_plugin.data_plane.backends.ray_cluster import import_ray
from tq_plugin.data_plane.client import FieldsLike
from tq_plugin.data_plane.rows import gather_rows

# Field blocks smaller than this stay in the actor's memory instead of the object store.
INLINE_BYTES = 64 << 10
_SAME_SIZE_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor; dtypes numpy lacks (bfloat16) as same-size uints."""
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_SIZE_UINT[t.element_size()]).numpy()


def as_torch(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """The tensor ``as_numpy`` came from, sharing ``a``'s memory (read-only buffers included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "array is not writable": never written
        t = torch.from_numpy(a)
    dtype = getattr(torch, dtype_name)
    return t if t.dtype == dtype else t.view(dtype)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.is_cpu else t.cpu()).contiguous()


def encode_fields(fields: FieldsLike | None) -> Any:
    """A put's payload as numpy buffers Ray ships out of band.

    Anything the fast path does not cover (non-tensor leaves, strided nested tensors, nested
    TensorDicts) travels as-is, and the store's validation names what is wrong with it.
    """
    if fields is None:
        return None
    batch = None
    if isinstance(fields, TensorDictBase):
        batch = tuple(fields.batch_size)
        items = list(fields.items())
    elif isinstance(fields, Mapping):
        items = list(fields.items())
    else:
        return ("raw", fields)
    out = []
    for name, v in items:
        if isinstance(v, NestedTensor) and v._ragged_idx == 1:
            if v._lengths is not None:
                v = v.contiguous()
            values, offsets = _cpu(v._values), _cpu(v._offsets)
            out.append((name, "jagged", dtype_name(values.dtype), as_numpy(values), offsets.numpy()))
        elif type(v) is torch.Tensor and not v.is_nested:
            check_storable(name, v)  # a sparse or meta tensor cannot become a numpy buffer
            t = _cpu(v)
            out.append((name, "dense", dtype_name(t.dtype), as_numpy(t), None))
        else:
            return ("raw", fields)
    return ("enc", batch, out)


class UnitKey(NamedTuple):
    """Where a storage unit (``ray_sharded``) holds a block in its own memory: the unit's actor
    (``namespace``, ``unit`` name) and the block's key there. Clients fetch blocks by it."""

    namespace: str
    unit: str
    key: int


class HeldKey:
    """The store actor's hold on a block a storage unit keeps (a ``RefColumn`` block value, as an
    ``ObjectRef`` is for a block in Ray's object store): when the last column lets go of it,
    the unit is told to free the block (``released_keys``, sent after the store's call).
    Pickled (a read's answer), it travels as the plain ``UnitKey``."""

    __slots__ = ("__weakref__", "where")

    def __init__(self, where: UnitKey) -> None:
        self.where = where

    def __reduce__(self) -> tuple:
        return (UnitKey, tuple(self.where))

    def __del__(self) -> None:
        _RELEASED.append(self.where)


# Keys whose last hold went (appended by HeldKey.__del__, drained by released_keys), and the one
# HeldKey of each live key, so two holds of a key never free it twice.
_RELEASED: collections.deque[UnitKey] = collections.deque()
_HELD: weakref.WeakValueDictionary[UnitKey, HeldKey] = weakref.WeakValueDictionary()
_HELD_LOCK = threading.Lock()


def hold(where: UnitKey) -> HeldKey:
    with _HELD_LOCK:
        held = _HELD.get(where)
        if held is None:
            held = _HELD[where] = HeldKey(where)
        return held


def released_keys() -> dict[tuple[str, str], list[int]]:
    """The keys no column holds any more, by unit (``(namespace, name)``); drained."""
    out: dict[tuple[str, str], list[int]] = {}
    while _RELEASED:
        try:
            where = _RELEASED.popleft()
        except IndexError:
            break
        out.setdefault((where.namespace, where.unit), []).append(where.key)
    return out


# (namespace, name) -> a storage unit's actor handle, looked up once per process.
UNIT_HANDLES: dict[tuple[str, str], Any] = {}


def unit_handle(namespace: str, name: str) -> Any:
    handle = UNIT_HANDLES.get((namespace, name))
    if handle is None:
        handle = UNIT_HANDLES[(namespace, name)] = import_ray().get_actor(name, namespace=namespace)
    return handle


class StagedBlock(NamedTuple):
    """A put's field block a storage unit (``ray_sharded``) already holds, in place of its
    bytes: the store checks the put against its shape and dtype alone."""

    held: UnitKey  # where the storage unit keeps the bytes
    shape: tuple[int, ...]


# Storage address of a decoded stand-in (``_stand_in``) -> the UnitKey of its bytes; an entry
# lives as long as the stand-in tensor (a weakref finalizer drops it).
_STAGED_REFS: dict[int, Any] = {}


def _stand_in(block: StagedBlock, dtype: str) -> torch.Tensor:
    """A tensor of ``block``'s shape and dtype over one element (stride 0, no bytes): validation
    reads shapes and dtypes, and ``stage_block`` maps it (or a view of it) back to the ref."""
    t = torch.zeros((), dtype=getattr(torch, dtype)).expand(*block.shape)
    key = t.untyped_storage().data_ptr()
    _STAGED_REFS[key] = block.held
    weakref.finalize(t, _STAGED_REFS.pop, key, None)
    return t


def decode_fields(payload: Any) -> FieldsLike | None:
    if payload is None:
        return None
    if payload[0] == "raw":
        return payload[1]
    _, batch, items = payload
    fields: dict[str, torch.Tensor] = {}
    for name, kind, dtype, data, offsets in items:
        t = _stand_in(data, dtype) if isinstance(data, StagedBlock) else as_torch(data, dtype)
        fields[name] = (
            t if kind == "dense"
            else torch.nested.nested_tensor_from_jagged(t, torch.from_numpy(np.asarray(offsets)))
        )
    return fields if batch is None else TensorDict(fields, batch_size=list(batch))


# ---------------------------------------------------------------- the actor's columns
class RefColumn:
    """A column whose bytes live in Ray objects (or small inline arrays): per slot, which block
    holds the row and where (``start``, ``length``, counted in elements of the column's shape).

    A dense row is one element; a jagged row is ``length`` elements. A block is released as
    soon as no live row points into it. Implements the column interface ``LocalDataPlane``
    drives (``reserve`` / ``write`` / ``drop`` / ``release`` / ``to_jagged`` / ``has`` / ``read``).
    """

    # Reads copy out of the (read-only) object store, so a reader can never change the rows.
    intact = True

    def __init__(self, spec: ColumnSpec) -> None:
        self.spec = spec
        self.present = np.zeros(0, dtype=bool)
        self.block = np.zeros(0, dtype=np.int64)
        self.start = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.live_rows = 0
        self.live_elements = 0
        self.blocks: dict[int, Any] = {}  # block id -> ObjectRef, or an inline numpy array
        self.block_rows: dict[int, int] = {}  # block id -> live rows pointing into it
        self.block_elements: dict[int, int] = {}
        self.block_bytes: dict[int, int] = {}
        self._next_block = 0
        n = 1
        for d in spec.shape:
            n *= d
        self.element_bytes = n * torch.empty((), dtype=spec.dtype).element_size()

    def has(self, slots: np.ndarray) -> np.ndarray:
        out = np.zeros(slots.shape[0], dtype=bool)
        inside = slots < self.present.shape[0]
        out[inside] = self.present[slots[inside]]
        return out

    def reserve(self, need_slots: int, extra_values: int = 0) -> bool:
        """Room for slots ``< need_slots`` (bookkeeping only: the block was staged already)."""
        if need_slots > self.present.shape[0]:
            cap = max(need_slots, 2 * self.present.shape[0])
            grown = []
            for old in (self.present, self.block, self.start, self.length):
                new = np.zeros(cap, dtype=old.dtype)
                new[: old.shape[0]] = old
                grown.append(new)
            self.present, self.block, self.start, self.length = grown
        return True  # every put adds a block: let the store re-read its peak

    def _unref(self, slots: np.ndarray) -> int:
        """Forget the live rows at ``slots``; release blocks no row points into. Elements gone."""
        gone = int(self.length[slots].sum())
        self.live_rows -= slots.shape[0]
        self.live_elements -= gone
        self.present[slots] = False
        ids, counts = np.unique(self.block[slots], return_counts=True)
        for b, c in zip(ids.tolist(), counts.tolist()):
            left = self.block_rows[b] - c
            if left:
                self.block_rows[b] = left
            else:
                del self.block_rows[b], self.blocks[b], self.block_bytes[b], self.block_elements[b]
        return gone

    def write(self, slots: np.ndarray, block: torch.Tensor, lengths: np.ndarray | None = None) -> int:
        """Point ``slots`` at the block staged for ``block``; returns the change in live bytes."""
        held, elements, nbytes = _take_staged(block)
        n = slots.shape[0]
        if lengths is None:
            lengths = np.ones(n, dtype=np.int64)
        old = slots[self.present[slots]]
        gone = self._unref(old) if old.shape[0] else 0
        bid = self._next_block
        self._next_block += 1
        self.blocks[bid], self.block_rows[bid] = held, n
        self.block_elements[bid], self.block_bytes[bid] = elements, nbytes
        self.block[slots] = bid
        self.start[slots] = np.cumsum(lengths) - lengths
        self.length[slots] = lengths
        self.present[slots] = True
        added = int(lengths.sum())
        self.live_rows += n
        self.live_elements += added
        return (added - gone) * self.element_bytes

    def drop(self, slots: np.ndarray) -> int:
        slots = slots[slots < self.present.shape[0]]
        slots = slots[self.present[slots]]
        return -self._unref(slots) * self.element_bytes if slots.shape[0] else 0

    def release(self) -> None:
        self.__init__(self.spec)  # type: ignore[misc]

    def to_jagged(self) -> RefColumn:
        """The same rows as a jagged column: a dense row ``[L, *t]`` becomes L elements ``t``."""
        width = self.spec.shape[0]
        col = RefColumn(ColumnSpec(True, self.spec.dtype, tuple(self.spec.shape[1:])))
        col.present, col.block = self.present.copy(), self.block.copy()
        col.start = self.start * width
        col.length = np.where(self.present, width, 0).astype(np.int64)
        col.live_rows, col.live_elements = self.live_rows, self.live_elements * width
        col.blocks, col.block_rows = dict(self.blocks), dict(self.block_rows)
        col.block_bytes = dict(self.block_bytes)
        col.block_elements = {b: e * width for b, e in self.block_elements.items()}
        col._next_block = self._next_block
        return col

    def locate(self, slots: np.ndarray) -> tuple[list[Any], list[int], np.ndarray, np.ndarray, np.ndarray]:
        """The blocks holding ``slots`` (each once, with its element count) and, per row, its
        block's position in that list, its start and its length."""
        ids, index = np.unique(self.block[slots], return_inverse=True)
        ids = ids.tolist()
        return ([self.blocks[b] for b in ids], [self.block_elements[b] for b in ids],
                index, self.start[slots], self.length[slots])

    def read(self, slots: np.ndarray) -> Any:
        """Scalar columns (a few bytes a row: claims read ``input_lengths``) and every column
        while a checkpoint is taken (``_RefStore.save``): the values, as ``LocalDataPlane``'s
        columns give them (jagged: values and offsets).

        Otherwise a placeholder of the right row count: ``LocalDataPlane.get_samples`` validates
        a read and calls this, and the actor answers reads with locations (``locate``).
        """
        scalar = not self.spec.jagged and self.spec.shape == ()
        if scalar or getattr(_FULL_READS, "on", False):
            blocks, elements, index, start, length = self.locate(slots)
            values = gather_blocks(fetch_blocks(blocks), elements, dtype_name(self.spec.dtype),
                             self.spec.shape, index, start, length)
            if not self.spec.jagged:
                return values
            offsets = torch.zeros(slots.shape[0] + 1, dtype=torch.int64)
            torch.cumsum(torch.from_numpy(length), 0, out=offsets[1:])
            return values, offsets
        placeholder = torch.zeros(slots.shape[0], dtype=torch.int8)
        return (placeholder, torch.arange(slots.shape[0] + 1)) if self.spec.jagged else placeholder

    @property
    def live_bytes(self) -> int:
        return self.live_elements * self.element_bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self.block_bytes.values())


# Set on the thread taking a checkpoint: columns then read their bytes, not placeholders.
_FULL_READS = threading.local()

# Blocks of the put being applied on this thread, keyed by id(prepared block): staged (copied
# or put into the object store) before the store's write phase, which must not fail part-way.
_STAGED = threading.local()


@contextlib.contextmanager
def full_reads() -> Iterator[None]:
    """While a checkpoint is taken on this thread: ``RefColumn.read`` returns the bytes."""
    _FULL_READS.on = True
    try:
        yield
    finally:
        _FULL_READS.on = False


@contextlib.contextmanager
def staged_blocks(staged: dict[int, tuple[Any, int, int]]) -> Iterator[None]:
    """While a put is applied on this thread: ``RefColumn.write`` takes the blocks staged for
    it (``{id(block): stage_block(block)}``) instead of staging them in the write phase."""
    _STAGED.blocks = staged
    try:
        yield
    finally:
        _STAGED.blocks = None


def stage_block(block: torch.Tensor) -> tuple[Any, int, int]:
    """``(held, elements, bytes)`` for a block: an inline copy, or a Ray object the caller owns
    (a block a storage unit holds already: a ``HeldKey`` on it, nothing copied)."""
    if _STAGED_REFS:
        where = _STAGED_REFS.get(block.untyped_storage().data_ptr())
        if where is not None:
            held = hold(where) if isinstance(where, UnitKey) else where
            return held, int(block.shape[0]), block.numel() * block.element_size()
    arr = as_numpy(block.contiguous())
    # Keep nothing that aliases the caller's (argument) buffers: copy small blocks, put big ones.
    held = arr.copy() if arr.nbytes < INLINE_BYTES else import_ray().put(arr)
    return held, int(block.shape[0]), int(arr.nbytes)


def _take_staged(block: torch.Tensor) -> tuple[Any, int, int]:
    staged = getattr(_STAGED, "blocks", None) or {}
    found = staged.get(id(block))
    return found if found is not None else stage_block(block)


def fetch_blocks(blocks: list[Any], timeout_s: float | None = None) -> list[np.ndarray]:
    """The arrays of ``blocks``: inline ones as they are; Ray objects, and the blocks storage
    units hold (one call per unit, for all of its keys), in one ``ray.get``."""
    refs: list[int] = []
    units: dict[tuple[str, str], list[int]] = {}
    for i, b in enumerate(blocks):
        if isinstance(b, np.ndarray):
            continue
        where = b.where if isinstance(b, HeldKey) else b
        if isinstance(where, UnitKey):
            units.setdefault((where.namespace, where.unit), []).append(i)
        else:
            refs.append(i)
    out = list(blocks)
    if not refs and not units:
        return out
    wanted = [blocks[i] for i in refs]
    for (namespace, name), idx in units.items():
        keys = [(blocks[i].where if isinstance(blocks[i], HeldKey) else blocks[i]).key for i in idx]
        wanted.append(unit_handle(namespace, name).get.remote(keys))
    got = import_ray().get(wanted, timeout=timeout_s)
    for i, arr in zip(refs, got):
        out[i] = arr
    for idx, arrays in zip(units.values(), got[len(refs):]):
        for i, arr in zip(idx, arrays):
            out[i] = arr
    return out


def gather_blocks(arrays: list[np.ndarray], elements: list[int], dtype: str, shape: tuple[int, ...],
                  index: np.ndarray, start: np.ndarray, length: np.ndarray) -> torch.Tensor:
    """Rows ``block[index[i]][start[i] : start[i] + length[i]]`` (in elements of ``shape``)
    joined into one new tensor."""
    arrays = [a.reshape(e, *shape) for a, e in zip(arrays, elements)]
    if len(arrays) == 1:
        return gather_rows(as_torch(arrays[0], dtype), start, length)
    if not arrays:
        return torch.empty((0, *shape), dtype=getattr(torch, dtype))
    rows = [arrays[b][s : s + n] for b, s, n in zip(index.tolist(), start.tolist(), length.tolist())]
    return as_torch(np.concatenate(rows), dtype)
