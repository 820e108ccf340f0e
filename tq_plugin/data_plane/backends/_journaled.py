"""The embedded store's journal calls (mixed into ``LocalDataPlane``): open and recover it,
append a mutation's record, wait for it to be durable, compact, and replay records.

``_journal`` holds the journal itself (format, recovery, group commit, compaction);
``docs/durability.md`` says what it promises.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tq_plugin.data_plane.backends._journal import Journal, JournalError, decode_group, quiet


class Journaled:
    """``LocalDataPlane``'s journal: its lock, partitions and public methods are the store's."""

    _journal: Journal | None
    _lock: Any
    _require_open: Any
    close: Any
    put_samples: Any
    register_partition: Any
    clear_samples: Any
    restore_claims: Any
    snapshot_partitions: Any

    def _open_journal(self, journal_dir: str | os.PathLike[str], sync: str, compact_bytes: int,
                      compact_records: int) -> None:
        """Open ``journal_dir`` and recover what it holds into this (empty) store."""
        journal = Journal(journal_dir, sync, compact_bytes=compact_bytes,
                          compact_records=compact_records)
        try:
            journal.recover(self, self._replay_records)
        except BaseException:
            journal.close()
            self.close()
            raise
        self._journal = journal
        if journal.due:
            self.compact_journal()

    @property
    def journal(self) -> Journal | None:
        """The store's journal (``journal_dir``), or None."""
        return self._journal

    def _log(self, header: dict[str, Any], buffers: Sequence[Any] = ()) -> int | None:
        """Append a mutation's record (under the lock, after it succeeded in memory)."""
        journal = self._journal
        return None if journal is None else journal.append(header, buffers)

    def _durable(self, ticket: int | None) -> None:
        """Wait until the record ``ticket`` names is as durable as ``journal_sync`` promises
        (outside the lock), then compact the journal when it is due."""
        if ticket is None:
            return
        journal = self._journal
        if journal is None:
            return
        journal.commit(ticket)
        if journal.due:
            self.compact_journal()

    def compact_journal(self) -> bool:
        """Fold the journal into a snapshot of the store now (False when one is already being
        written); recovery then replays only what comes after it."""
        journal = self._journal
        if journal is None:
            raise ValueError("compact_journal: this store has no journal_dir")
        with self._lock:
            self._require_open()
            seq = journal.cut()
            if seq is None:
                return False
            try:
                snaps = self.snapshot_partitions()
            except BaseException:
                journal.write_snapshot_failed()
                raise
        journal.write_snapshot(snaps, seq)
        return True

    def _replay_records(self, group: list[tuple[dict[str, Any], memoryview]]) -> None:
        """Apply journal records through the public methods (journaling is off meanwhile): a
        run of consecutive puts as one put (the same rows, tags and order), else one record."""
        header = group[0][0]
        op, pid = header.get("o"), header.get("p")
        if op == "put":
            tags = None
            if any(h["t"] is not None for h, _ in group):
                tags = [t for h, _ in group for t in (h["t"] or [{}] * len(h["i"]))]
            fields = decode_group(group) if header["f"] else None
            ids = [sid for h, _ in group for sid in h["i"]]
            try:
                self.put_samples(partition_id=pid, sample_ids=ids, fields=fields, tags=tags,
                                 mode=header["m"])
            except Exception:
                if len(group) == 1:
                    raise
                for record in group:  # name the record that fails (a put lands whole or not)
                    self._replay_records([record])
        elif op == "reg":
            self.register_partition(pid, header["f"], header["n"], header["c"], header["g"],
                                    header["e"] or None, jagged_fields=header["j"])
        elif op == "clr":
            quiet(lambda: self.clear_samples(partition_id=pid, sample_ids=header["i"]))
        elif op == "claim":
            self.restore_claims(pid, header["c"])
        else:
            raise JournalError(f"a journal record has an unknown operation {op!r}")
