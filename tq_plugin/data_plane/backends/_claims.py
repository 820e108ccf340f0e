"""Task-mediated reads for the embedded backend: per-task claim cursors over a partition.

A consumer task claims rows whose required fields are written, in first-put order, and never
gets the same row twice (reference: ``claim_meta`` / ``get_data`` / ``check_consumption_status``).
Mixed into ``LocalDataPlane``, whose lock, condition and partitions it uses.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict

from tq_plugin.data_plane.backends._validate import copy_tag, str_list
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import INPUT_LENGTHS


class TaskCursors:
    _produced: Any
    _lock: Any
    _require_open: Any
    _partition: Any
    _journal: Any
    _log: Any
    _durable: Any
    get_samples: Any

    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` rows whose ``required_fields`` are all written.

        Rows are claimed in first-put order and never handed to the same task twice; they stay
        readable until cleared. Blocking waits for a producer's put (another thread), and
        raises ``TimeoutError`` after ``timeout_s``; non-blocking returns an empty meta.
        ``dp_rank`` is accepted for interface parity and ignored (one process, one cursor).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"claim_meta: batch_size must be an int, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"claim_meta: batch_size must be >= 1, got {batch_size}")
        required = str_list(required_fields, "claim_meta", "required_fields")
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._produced:
            while True:
                self._require_open()
                part = self._partition(partition_id)
                if task_name not in part.consumed:
                    raise KeyError(
                        f"claim_meta: unknown consumer task {task_name!r} for partition "
                        f"{partition_id!r}; registered tasks: {sorted(part.consumed)}"
                    )
                ids = self._ready(part, task_name, required, batch_size)
                if ids or not blocking:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"claim_meta: no rows with fields {required} became ready for task "
                        f"{task_name!r} within {timeout_s}s"
                    )
                self._produced.wait(left)
            if ids and self._journal is not None:
                self._journal.check_usable()
            part.consumed[task_name].update(ids)
            part.drop_pending(task_name, ids)
            # A claim is a mutation: journaled as the rows it handed out (replayed as such).
            ticket = self._log({"o": "claim", "p": partition_id, "c": {task_name: ids}}) if ids else None
            lengths = self._column_ints(part, INPUT_LENGTHS, ids)
            tags = [copy_tag(part.tags.get(s, {})) for s in ids]
        self._durable(ticket)
        return KVBatchMeta(
            partition_id=partition_id,
            task_name=task_name,
            sample_ids=ids,
            fields=required,
            sequence_lengths=lengths,
            tags=tags,
        )

    @staticmethod
    def _ready(part: Any, task: str, required: list[str], limit: int) -> list[str]:
        """Up to ``limit`` unclaimed ids, in first-put order, whose required fields are written.

        Walks the task's pending rows (live, unclaimed, in order) in chunks and checks each chunk
        with one vectorized presence test per field, so a claim costs what it hands out (plus
        any not-yet-ready rows ahead of them), not a scan of the whole partition.
        """
        pending = part.pending[task]
        if not required:
            return list(itertools.islice(pending, limit))
        cols = [part.columns.get(name) for name in required]
        if any(c is None for c in cols):
            return []
        picked: list[str] = []
        walk = iter(pending)
        chunk = max(2 * limit, 64)
        while len(picked) < limit:
            ids = list(itertools.islice(walk, chunk))
            if not ids:
                break
            slots = np.fromiter(map(part.slot_of.__getitem__, ids), dtype=np.int64, count=len(ids))
            ready = np.ones(len(ids), dtype=bool)
            for col in cols:
                ready &= col.has(slots)
            picked.extend(ids[i] for i in np.flatnonzero(ready)[: limit - len(picked)].tolist())
        return picked

    @staticmethod
    def _column_ints(part: Any, name: str, ids: list[str]) -> list[int] | None:
        col = part.columns.get(name)
        if not ids or col is None or col.spec.jagged or col.spec.shape != ():
            return None
        slots = np.array([part.slot_of[s] for s in ids], dtype=np.int64)
        if not bool(col.has(slots).all()):
            return None
        return [int(x) for x in col.read(slots).tolist()]  # type: ignore[union-attr]

    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> TensorDict:
        """Read a claimed meta's rows: ``select_fields``, else ``meta.fields`` (never "all")."""
        names = list(select_fields) if select_fields else list(meta.fields or ())
        if not names:
            raise ValueError("get_data: pass select_fields or a meta with fields; there is no fetch-all")
        return self.get_samples(
            partition_id=meta.partition_id, sample_ids=meta.sample_ids, select_fields=names
        )

    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every listed task has claimed every live row of the partition."""
        tasks = str_list(task_names, "check_consumption_status", "task_names")
        with self._lock:
            self._require_open()
            part = self._partition(partition_id)
            # A task's pending rows are exactly the live rows it has not claimed.
            return all(task in part.pending and not part.pending[task] for task in tasks)
