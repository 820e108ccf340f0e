"""The embedded store's per-partition state, and its defaults.

A ``Partition`` holds its schema (declared and jagged field names, row limit, consumer tasks),
the id -> slot map with its free list, one column per field, tags, first-put order and each
consumer task's queue of unclaimed rows, plus the one-row write buffer (``_buffer``).
``snapshot`` copies it for a checkpoint (``tq_plugin.data_plane.checkpoint``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tq_plugin.data_plane.backends._buffer import RowPlan
from tq_plugin.data_plane.backends._columns import DenseColumn, JaggedColumn
from tq_plugin.data_plane.backends._validate import str_list
from tq_plugin.data_plane.checkpoint import PartitionSnapshot

PUT_MODES = ("upsert", "insert", "update")
# The default capacity: this share of the memory available when the store is created. Buffers
# keep geometric headroom (up to 2x live), so this keeps a full store under what is available.
DEFAULT_CAPACITY_FRACTION = 0.4


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo, else the physical memory size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Partition:
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
    # first-put order per slot (a numpy array: no per-row Python work on puts)
    arrival: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    consumed: dict[str, set[str]] = field(default_factory=dict)  # task -> claimed live ids
    # task -> live ids it has not claimed, in first-put order (dicts keep insertion order), so
    # a claim looks at the rows it hands out, not at every row of the partition.
    pending: dict[str, dict[str, None]] = field(default_factory=dict)
    # per task, entries deleted from its pending dict since it was last rebuilt: a dict keeps
    # deleted slots until it is rebuilt, and iteration walks them
    pending_dead: dict[str, int] = field(default_factory=dict)
    # One-row puts of a known row layout wait here, packed, until a read (or a full buffer)
    # writes them into the columns in one batch: (slot, plan, each field's bytes, the jagged
    # fields' lengths, bytes in all).
    buffered: list[tuple[int, RowPlan, list[bytes], list[int], int]] = field(default_factory=list)
    plans: dict[tuple, RowPlan] = field(default_factory=dict)
    epoch: int = 0  # bumped whenever a column or the schema changes; plans of older epochs lapse

    def drop_pending(self, task: str, ids: Any) -> None:
        """Take ``ids`` off ``task``'s queue of unclaimed rows (claimed or cleared).

        Once deleted slots outnumber live entries the dict is rebuilt, so walking the queue
        from its front costs the rows it hands out, not every row ever claimed (amortized O(1)).
        """
        pending = self.pending[task]
        before = len(pending)
        for sid in ids:
            pending.pop(sid, None)
        dead = self.pending_dead.get(task, 0) + before - len(pending)
        if dead > len(pending) + 64:
            self.pending[task] = dict(pending)
            dead = 0
        self.pending_dead[task] = dead

    @property
    def live_bytes(self) -> int:
        return sum(c.live_bytes for c in self.columns.values())

    def snapshot(self) -> PartitionSnapshot:
        """A copy of the live rows and state, for a checkpoint (call under the store's lock)."""
        ids = list(self.slot_of)
        slots = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(ids))
        order = np.argsort(self.arrival[slots], kind="stable") if len(ids) else slots
        ids = [ids[i] for i in order.tolist()]
        slots = slots[order]
        fields: list[dict[str, Any]] = []
        tensors: dict[str, torch.Tensor] = {}
        for name, col in sorted(self.columns.items()):
            rows = np.flatnonzero(col.has(slots)) if len(ids) else np.zeros(0, dtype=np.int64)
            if rows.shape[0] == 0:
                continue  # no live data: the column's kind is free again, like in the live store
            key = str(len(fields))
            spec = col.spec
            fields.append({
                "name": name,
                "kind": "jagged" if spec.jagged else "dense",
                "dtype": str(spec.dtype).removeprefix("torch."),
                "shape": list(spec.shape),
            })
            tensors[f"{key}.rows"] = torch.from_numpy(rows.astype(np.int64))
            if spec.jagged:
                values, offsets = col.read(slots[rows])
                tensors[f"{key}.values"] = values.contiguous()
                tensors[f"{key}.lengths"] = offsets.diff().contiguous()
            else:
                tensors[f"{key}.data"] = col.read(slots[rows]).contiguous()
        live = set(ids)
        tags = {sid: dict(t) for sid, t in self.tags.items() if t and sid in live}
        entry = {
            "partition_id": self.partition_id,
            "declared": sorted(self.declared),
            "jagged": sorted(self.jagged),
            "num_samples": self.num_samples,
            "consumer_tasks": list(self.consumer_tasks),
            "grpo_group_size": self.grpo_group_size,
            "enums": {k: list(v) for k, v in self.enums.items()},
            "sample_ids": ids,
            "tags": tags,
            "consumed": {task: sorted(c & live) for task, c in self.consumed.items()},
            "fields": fields,
        }
        return PartitionSnapshot(entry, tensors)


def checked_enums(enums: Any, where: str) -> dict[str, list[str]]:
    if enums is None:
        return {}
    if not isinstance(enums, Mapping):
        raise TypeError(f"{where}: enums must map field names to lists of strings, got {type(enums).__name__}")
    return {
        str_list([name], where, "enums keys")[0]: str_list(vocab, where, f"enums[{name!r}]")
        for name, vocab in copy.deepcopy(dict(enums)).items()
    }
