"""The Ray store sharded: one metadata controller, the bytes on ``S`` storage units.

``RayDataPlane(num_storage_units=S)`` (``tq.backend.num_storage_units`` on ``tq/backend=ray``)
keeps the store's one actor (``ray_actor``) as the controller, and adds ``S`` storage-unit
actors that hold the bytes:

* **Metadata in one place.** Schema, validation, row ids and slots, tags, first-put order, claim
  cursors and the receipts (``KVBatchMeta``) stay in the controller, exactly as with one actor,
  so a claim never hands out a row twice and every put is checked against one schema.
* **A put is one call, to a unit; its bytes are copied once there.** A put whose field blocks
  of at least ``min_bytes`` (and two or more elements) a unit can take goes to the unit its
  first sample id hashes to (CRC-32 modulo ``S``). The unit copies those blocks out of the
  call's argument into its own memory (the one copy of the bytes a put makes past Ray's
  transport; no Ray object is made, so the unit, not the writer, keeps them: a writer may exit
  once its put returned), then forwards the put to the controller with a ``StagedBlock`` (the
  block's ``UnitKey``, its shape) in place of each such block: a small call, which the
  controller validates against shapes and dtypes (it never reads those bytes) and answers; the
  unit hands the answer (the receipt) back. The controller's work per put does not grow with
  the put's bytes; puts that reach a unit while its call to the controller is under way go
  together in its next call (``_StoreHost.call_batch``), so under load the controller runs one
  Ray call for several puts. A put the controller refuses writes nothing: the unit drops the
  blocks and raises the controller's error as it is. ``input_lengths`` (the controller reads its values),
  one-element blocks and jagged blocks whose offsets do not span their values travel inline; a
  put with nothing for a unit goes to the controller directly.
* **Reads gather from every unit at once.** The controller answers a read with where the
  blocks are; the client asks each unit holding some for all of its blocks, and waits on those
  calls (and any Ray objects) in one ``ray.get``.
* **A clear is atomic across units**: only the controller's metadata says which rows exist, and
  it drops a cleared row's hold on its block under its lock; once no row holds a block
  (``HeldKey``), the controller tells the unit to free it, after the call. A read racing a
  clear of the same rows may find a block gone: it fails with a ``KeyError`` naming the unit.
* **Checkpoints cover every unit**: ``save`` runs in the controller, which fetches every row's
  bytes from whichever unit holds them; ``restore`` puts the rows back through the controller
  (it then owns their blocks, as Ray objects).

A unit that dies loses the bytes it holds (reads of those rows fail), as the single actor's
death loses all of them.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tq_plugin.data_plane.backends.ray_cluster import import_ray
from tq_plugin.data_plane.backends.ray_columns import (
    INLINE_BYTES,
    UNIT_HANDLES,
    StagedBlock,
    UnitKey,
    released_keys,
    unit_handle,
)
from tq_plugin.data_plane.schema import INPUT_LENGTHS

_PUTS = "puts"  # a unit's concurrency group for puts


class _Pending:
    """A put waiting in a unit for the controller's answer."""

    __slots__ = ("done", "error", "kwargs", "lead", "result", "store", "wake")

    def __init__(self, store: str, kwargs: dict) -> None:
        self.store, self.kwargs = store, kwargs
        self.wake = threading.Event()  # set after done or lead is
        self.done = False  # the controller answered (result or error)
        self.lead = False  # this put's thread is to forward the next batch
        self.result: Any = None
        self.error: BaseException | None = None


class _StorageUnit:
    """A storage-unit actor: keeps the blocks of the puts routed to it, in its own memory, and
    forwards each put's metadata to the controller (the store actor ``controller``).

    Puts that arrive while one call to the controller is under way wait, and go in the next
    call together (``_StoreHost.call_batch``: each applied on its own, with its own receipt or
    error), so the controller runs one Ray call for many puts when they come fast."""

    def __init__(self, namespace: str, name: str, controller: str) -> None:
        self._namespace, self._name, self._controller_name = namespace, name, controller
        self._controller: Any = None
        self._blocks: dict[int, np.ndarray] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._forwarding = False

    def put(self, store: str, kwargs: dict, picked: list[int], timeout_s: float) -> Any:
        """Keep the payload's blocks at ``picked`` and put the rest, with a ``StagedBlock`` for
        each kept block, through the controller; its answer (the receipt) or its error."""
        ray = import_ray()
        _, batch, items = kwargs["fields"]
        items, keys = list(items), []
        for i in picked:
            name, kind, dtype, data, offsets = items[i]
            key = next(self._keys)
            # A copy: the argument's buffer is Ray's (shared memory the caller owns).
            self._blocks[key] = np.array(data, copy=True)
            keys.append(key)
            where = UnitKey(self._namespace, self._name, key)
            items[i] = (name, kind, dtype, StagedBlock(where, tuple(data.shape)), offsets)
        if self._controller is None:
            self._controller = ray.get_actor(self._controller_name, namespace=self._namespace)
        mine = _Pending(store, {**kwargs, "fields": ("enc", batch, items)})
        with self._lock:
            self._queue.append(mine)
            mine.lead = not self._forwarding
            self._forwarding = True
        deadline = time.monotonic() + timeout_s
        while True:
            if mine.lead:
                mine.lead = False
                self._forward(timeout_s)
            if mine.done:
                break
            if not mine.wake.wait(max(0.0, deadline - time.monotonic())):
                # Its put may still land: the blocks stay (a leak, never a row without bytes).
                raise TimeoutError(f"storage unit {self._name!r}: no answer from the store "
                                   f"actor in {timeout_s:g} s")
            mine.wake.clear()
        if mine.error is not None:
            for key in keys:  # refused: nothing of it stays
                self._blocks.pop(key, None)
            raise mine.error
        return mine.result

    def _forward(self, timeout_s: float) -> None:
        """Send every waiting put to the controller in one call; hand the lead on after."""
        ray = import_ray()
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            answers = ray.get(self._controller.call_batch.remote(
                [(p.store, p.kwargs) for p in batch]), timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - the call failed: every put of it did
            cause = getattr(err, "cause", None)
            if isinstance(err, ray.exceptions.RayTaskError) and isinstance(cause, Exception):
                err = cause
            answers = [(False, err)] * len(batch)
        for p, (ok, value) in zip(batch, answers):
            if ok:
                p.result = value
            else:
                p.error = value
            p.done = True
            p.wake.set()
        with self._lock:
            if self._queue:  # the first put that came meanwhile forwards the next batch
                self._queue[0].lead = True
                self._queue[0].wake.set()
            else:
                self._forwarding = False

    def get(self, keys: list[int]) -> list[np.ndarray]:
        try:
            return [self._blocks[k] for k in keys]
        except KeyError as err:
            raise KeyError(f"storage unit {self._name!r}: block {err.args[0]} is gone (its rows "
                           "were cleared, perhaps while this read ran)") from None

    def free(self, keys: list[int]) -> None:
        for k in keys:
            self._blocks.pop(k, None)

    def held(self) -> tuple[int, int]:
        """``(blocks, bytes)`` this unit holds (tests check a clear frees them)."""
        return len(self._blocks), sum(a.nbytes for a in self._blocks.values())

    def pid(self) -> int:
        return os.getpid()


def free_released() -> None:
    """Tell each unit to free the blocks the store actor no longer holds (fire and forget: a
    unit frees them in order with the calls that follow)."""
    for (namespace, name), keys in released_keys().items():
        try:
            unit_handle(namespace, name).free.remote(keys)
        except ValueError:  # no such unit (gone with its cluster): nothing left to free
            UNIT_HANDLES.pop((namespace, name), None)


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
    namespace), and the put-side step that routes a put to one of them."""

    def __init__(self, actor_name: str, namespace: str, count: int, *, create: bool = True,
                 min_bytes: int = INLINE_BYTES, op_timeout_s: float = 300.0) -> None:
        ray = import_ray()
        self.count = checked_units(count)
        self.min_bytes = int(min_bytes)
        self.op_timeout_s = float(op_timeout_s)
        self.units = []
        for k in range(self.count):
            name = f"{actor_name}_unit{k}"
            handle = UNIT_HANDLES.get((namespace, name))
            if handle is None:
                if create:
                    # num_cpus=0 like the controller: the units never take a worker's CPU slot.
                    # Puts wait in the unit for the controller's answer, in threads of their
                    # own: a read, a free (and the controller's own reads, under its lock)
                    # always find a thread, however many puts are waiting.
                    handle = (ray.remote(max_concurrency=8, concurrency_groups={_PUTS: 16})(
                                  _StorageUnit)
                              .options(name=name, namespace=namespace, num_cpus=0,
                                       get_if_exists=True)
                              .remote(namespace, name, actor_name))
                else:
                    handle = ray.get_actor(name, namespace=namespace)
                UNIT_HANDLES[(namespace, name)] = handle
            self.units.append(handle)

    def put(self, store: str, kwargs: dict) -> tuple[bool, Any]:
        """Route a put (``put_samples``' keywords, its fields ``encode_fields``'s payload) to the
        unit its first sample id hashes to: ``(True, receipt)``. ``(False, None)`` when no
        block of it is for a unit, or it is malformed (the controller then takes it as it is,
        so its error names it exactly as with one actor)."""
        payload, sample_ids = kwargs.get("fields"), kwargs.get("sample_ids")
        if (payload is None or payload[0] != "enc" or not isinstance(sample_ids, Sequence)
                or isinstance(sample_ids, str) or not sample_ids
                or not isinstance(sample_ids[0], str)):
            return False, None
        picked = shipped(payload[2], self.min_bytes)
        if not picked:
            return False, None
        unit = self.units[unit_of(sample_ids[0], self.count)]
        call = unit.put.options(concurrency_group=_PUTS)
        return True, import_ray().get(call.remote(store, kwargs, picked, self.op_timeout_s),
                                      timeout=self.op_timeout_s + 5.0)

    def pids(self) -> list[int]:
        """The storage units' process ids (benchmarks read their CPU time)."""
        return import_ray().get([u.pid.remote() for u in self.units], timeout=self.op_timeout_s)


__all__ = ["StorageUnits", "checked_units", "free_released", "shipped", "unit_of"]
