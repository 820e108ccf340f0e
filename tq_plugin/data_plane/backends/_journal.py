"""The embedded store's write-ahead journal: what was acknowledged survives a crash.

``LocalDataPlane(journal_dir=D, journal_sync=...)`` appends one record per mutation (register,
put, clear, claim) to ``D`` under the store's lock, after the mutation succeeded in memory and
before the call returns. A put is one record whatever its row count: its fields' raw bytes go
to the file in one ``writev``, nothing per row. Opening a store on ``D`` again replays the
snapshot and the records after it, through the store's own public methods, so every recovered
row is revalidated by the same rules as a live put.

``journal_sync``:

* ``"always"``: ``fdatasync`` after each record, under the store's lock, before the call
  returns (one flush per acknowledgement; survives a power loss);
* ``"batch"``: group commit; the record is written under the lock and the call waits, outside
  the lock, for an ``fdatasync`` that covers it. Whoever finds no flush running starts one for
  everything written so far, so concurrent writers share flushes (survives a power loss);
* ``"off"``: the record is written (the OS holds it: a killed process loses nothing, a machine
  that goes down may lose the last records), never flushed by the store.

A record on disk::

    magic "TQJ1" | header length u32 | payload length u64 | crc32 of header + payload u32
    header: JSON (space-padded so the payload starts 8-byte aligned)
    payload: each tensor's raw bytes, each padded to 8 bytes (dtype and shape are in the header)

Nothing is unpickled; a tensor comes back from its bytes with a dtype from a fixed table. A
record whose length or checksum does not hold at the end of the newest segment is a torn tail
(written when the process died, never acknowledged): it is dropped and the file cut there. A
bad record anywhere else is damage to acknowledged data and raises ``JournalError``.

Directory ``D`` (0700, files 0600)::

    LOCK                   flock'ed by the open store: one process per journal
    snapshot/              the store's ``save`` checkpoint; its metadata names the first segment
                           after it (``journal.next_segment``)
    journal-<seq>.log      segments, replayed in order from ``next_segment``

Compaction bounds recovery time: once the segments since the snapshot pass ``compact_bytes``
or ``compact_records``, the store cuts a new segment and copies itself under its lock (a
consistent cut), then writes the snapshot outside the lock and deletes the segments before the
cut. A crash at any point of that leaves either the old snapshot and every segment after it, or
the new snapshot (stale segments before its cut are removed at the next open).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import struct
import threading
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tq_plugin.data_plane.checkpoint import (
    _DTYPES,
    CheckpointError,
    PartitionSnapshot,
    check_tag_value,
    load_into,
    save_store,
)
from tq_plugin.data_plane.jagged import nested_from_lengths

SYNC_MODES = ("off", "batch", "always")
MAGIC = b"TQJ1"
_HEAD = struct.Struct("<4sIQI")  # magic, header length, payload length, crc32
_ALIGN = 8
_PAD = bytes(_ALIGN)
SNAPSHOT = "snapshot"
_SEGMENT = re.compile(r"^journal-(\d{8})\.log$")
_IOV_MAX = 512  # iovecs per writev (Linux allows 1024)


def segment_name(seq: int) -> str:
    return f"journal-{seq:08d}.log"


class JournalError(RuntimeError):
    """The journal cannot record a call, or holds damage to records already acknowledged."""


# ---------------------------------------------------------------------- tensors <-> bytes
def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy when it is a contiguous CPU tensor."""
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.dtype.is_complex or flat.dtype not in _DTYPE_NAMES:
        raise JournalError(f"the journal cannot hold dtype {t.dtype}")
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


_DTYPE_NAMES = {d: name for name, d in _DTYPES.items()}


def encode_fields(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[list[Any]], list[memoryview]]:
    """Each field's header entry and raw buffers: dense ``[name, "d", dtype, shape]`` with its
    bytes; jagged ``[name, "j", dtype, values shape, rows]`` with its values, then its rows'
    int64 lengths."""
    entries: list[list[Any]] = []
    buffers: list[memoryview] = []
    for name, value in items:
        if value.is_nested:
            offsets = value._offsets.detach().cpu().to(torch.int64)
            if value._lengths is not None:  # a narrowed view: make its rows back to back
                value = value.contiguous()
                offsets = value._offsets.detach().cpu().to(torch.int64)
            lengths = offsets.diff()
            values = value._values
            if offsets.shape[0] > 1:
                values = values[int(offsets[0]) : int(offsets[-1])]
            dtype = _DTYPE_NAMES.get(values.dtype)
            if dtype is None:
                raise JournalError(f"put_samples: field {name!r}: the journal cannot hold dtype {values.dtype}")
            entries.append([name, "j", dtype, list(values.shape), int(lengths.shape[0])])
            buffers += (_raw(values), _raw(lengths))
        else:
            dtype = _DTYPE_NAMES.get(value.dtype)
            if dtype is None:
                raise JournalError(f"put_samples: field {name!r}: the journal cannot hold dtype {value.dtype}")
            entries.append([name, "d", dtype, list(value.shape)])
            buffers.append(_raw(value))
    return entries, buffers


_ITEMSIZE = {name: torch.empty(0, dtype=d).element_size() for name, d in _DTYPES.items()}
_MERGE_ROWS = 4096  # rows per replayed put at most (consecutive puts are replayed as one)
_MERGE_BYTES = 64 << 20


def _buffers(entries: list[list[Any]]) -> list[tuple[int, int]]:
    """Each buffer's (start, size) in a record's payload, in payload order (a jagged field has
    two: values, lengths)."""
    out = []
    at = 0
    for entry in entries:
        kind, dtype_name, shape = entry[1], entry[2], entry[3]
        size = math.prod(shape) * _ITEMSIZE[dtype_name]
        out.append((at, size))
        at += -(-size // _ALIGN) * _ALIGN
        if kind == "j":
            size = 8 * entry[4]
            out.append((at, size))
            at += -(-size // _ALIGN) * _ALIGN
    return out


def _field_key(entry: list[Any]) -> tuple:
    """What consecutive puts must share, field by field, to be replayed as one put: name, kind,
    dtype and the row shape (a dense field of 2+ dims may differ in dim 1: rows of different
    lengths, which the store keeps jagged)."""
    name, kind, dtype, shape = entry[:4]
    if kind == "d" and len(shape) >= 2:
        return name, kind, dtype, len(shape), tuple(shape[2:])
    return name, kind, dtype, len(shape), tuple(shape[1:])


def put_key(header: dict[str, Any]) -> tuple | None:
    """The merge key of a put record (None: replay it alone)."""
    entries = header.get("f")
    if header.get("o") != "put" or not entries:
        return None
    return header["p"], header["m"], tuple(_field_key(e) for e in entries)


def _joined(chunks: list[memoryview], dtype: torch.dtype) -> torch.Tensor:
    raw = bytearray().join(chunks)
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


def decode_group(group: Sequence[tuple[dict[str, Any], memoryview]]) -> dict[str, torch.Tensor]:
    """The fields of consecutive put records (same ``put_key``) as one put's: each field's
    bytes joined once, one tensor per field (no per-row torch work)."""
    layouts = []
    for header, payload in group:
        bufs = _buffers(header["f"])
        end = bufs[-1][0] + bufs[-1][1] if bufs else 0
        if end > len(payload):
            raise JournalError("a record's payload is shorter than its header says")
        layouts.append(bufs)
    fields: dict[str, torch.Tensor] = {}
    b = 0
    for i, entry in enumerate(group[0][0]["f"]):
        name, kind, dtype_name = entry[:3]
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise JournalError(f"a record names an unknown dtype {dtype_name!r}")
        values = _joined([payload[lay[b][0]: lay[b][0] + lay[b][1]]
                          for (_, payload), lay in zip(group, layouts)], dtype)
        shapes = [header["f"][i][3] for header, _ in group]
        if kind == "j":
            lengths = _joined([payload[lay[b + 1][0]: lay[b + 1][0] + lay[b + 1][1]]
                               for (_, payload), lay in zip(group, layouts)], torch.int64)
            fields[name] = nested_from_lengths(values.reshape(-1, *shapes[0][1:]), lengths)
            b += 2
            continue
        b += 1
        if all(s[1:] == shapes[0][1:] for s in shapes):
            fields[name] = values.reshape(sum(s[0] for s in shapes), *shapes[0][1:])
        else:  # rows of different lengths (dim 1): one jagged put, as the store would keep them
            lengths = torch.from_numpy(np.repeat(np.array([s[1] for s in shapes], dtype=np.int64),
                                                 [s[0] for s in shapes]))
            fields[name] = nested_from_lengths(values.reshape(-1, *shapes[0][2:]), lengths)
    return fields


def decode_fields(entries: list[list[Any]], payload: memoryview) -> dict[str, torch.Tensor]:
    """One put record's fields as tensors."""
    return decode_group([({"f": entries}, payload)])


# ---------------------------------------------------------------------- the journal
def _writev_all(fd: int, pieces: list[Any]) -> None:
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        batch = views[:_IOV_MAX]
        done = os.writev(fd, batch)
        while done:
            first = views[0]
            if done >= len(first):
                done -= len(first)
                views.pop(0)
            else:
                views[0] = first[done:]
                done = 0


class _SnapshotOf:
    """A store's partitions copied at the cut, for ``save_store``."""

    def __init__(self, snaps: list[PartitionSnapshot]) -> None:
        self._snaps = snaps

    def snapshot_partitions(self) -> list[PartitionSnapshot]:
        return self._snaps


class Journal:
    """One store's journal directory, held by this process (``flock``) while it is open."""

    def __init__(self, root: str | os.PathLike[str], sync: str = "off", *,
                 compact_bytes: int = 256 << 20, compact_records: int = 20_000) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"LocalDataPlane: journal_sync must be one of {SYNC_MODES}, got {sync!r}")
        for key, value in (("journal_compact_bytes", compact_bytes),
                           ("journal_compact_records", compact_records)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LocalDataPlane: {key} must be an int >= 1, got {value!r}")
        self.root = Path(root)
        self.sync = sync
        self.compact_bytes = compact_bytes
        self.compact_records = compact_records
        if self.root.exists() and not self.root.is_dir():
            raise JournalError(f"journal_dir {str(self.root)!r} exists and is not a directory")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / "LOCK", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise JournalError(
                f"journal_dir {str(self.root)!r} is open in another store (its LOCK is held); "
                "one process writes a journal at a time"
            ) from None
        self._fd: int | None = None
        self.seq = 0
        self._written = 0  # bytes appended by this process (the tickets commit waits for)
        self._synced = 0
        self._cond = threading.Condition()
        self._syncing = False
        self._compacting = False
        self.failed: BaseException | None = None
        self.bytes_since_snapshot = 0
        self.records_since_snapshot = 0
        self.recovered_records = 0
        self.dropped_tail_bytes = 0

    # ------------------------------------------------------------------ recovery
    def recover(self, store: Any, apply: Callable[[list[tuple[dict[str, Any], memoryview]]], None]) -> None:
        """Load the snapshot into ``store``, replay the segments after it through ``apply``
        (a run of consecutive puts that ``put_key`` says may go as one, else one record at a
        time), then open a new segment for this process's records."""
        next_seg = 0
        snap = self.root / SNAPSHOT
        has_snapshot = snap.is_dir() or any(p.name.startswith(f"{SNAPSHOT}.old-") for p in self.root.iterdir())
        if has_snapshot:
            try:
                restored = load_into(store, snap)
            except CheckpointError as err:
                raise JournalError(f"journal_dir {str(self.root)!r}: its snapshot is unreadable: {err}") from None
            meta = restored.metadata.get("journal")
            if not isinstance(meta, dict) or not isinstance(meta.get("next_segment"), int):
                raise JournalError(f"journal_dir {str(self.root)!r}: the snapshot names no journal segment")
            next_seg = meta["next_segment"]
        segments = sorted(
            (int(m.group(1)), p) for p in self.root.iterdir() if (m := _SEGMENT.match(p.name))
        )
        for seq, path in segments:
            if seq < next_seg:  # folded into the snapshot by a compaction that ended in a crash
                path.unlink()
        live = [(seq, p) for seq, p in segments if seq >= next_seg]
        expected = next_seg
        for seq, _ in live:
            if seq != expected:
                raise JournalError(
                    f"journal_dir {str(self.root)!r}: segment {segment_name(expected)} is missing "
                    f"(found {segment_name(seq)}); acknowledged records would be lost"
                )
            expected += 1
        for i, (seq, path) in enumerate(live):
            self._replay(path, apply, last=i == len(live) - 1)
        self.seq = expected if live else next_seg
        self._open_segment(self.seq)

    def _replay(self, path: Path, apply: Callable[[list[tuple[dict[str, Any], memoryview]]], None],
                *, last: bool) -> None:
        size = path.stat().st_size
        data = bytearray(size)
        with open(path, "rb", buffering=0) as f:
            got = f.readinto(data)
        view = memoryview(data)[:got]
        at = 0
        group: list[tuple[dict[str, Any], memoryview]] = []
        group_at, group_key, group_ids, group_bytes = 0, None, set(), 0

        def flush() -> None:
            if not group:
                return
            try:
                apply(group)
            except JournalError:
                raise
            except Exception as err:
                raise JournalError(
                    f"journal segment {str(path)!r}: the record at byte {group_at} "
                    f"({group[0][0].get('o')!r}) does not replay: {type(err).__name__}: {err}"
                ) from err
            self.recovered_records += len(group)
            group.clear()

        while at < got:
            checked = self._check_record(view, at)
            if isinstance(checked, str):
                flush()
                if not last:
                    raise JournalError(
                        f"journal segment {str(path)!r} is damaged at byte {at} ({checked}), "
                        "before newer segments: acknowledged records cannot be read back"
                    )
                self.dropped_tail_bytes = got - at
                with open(path, "r+b") as f:  # the torn tail was never acknowledged: cut it
                    f.truncate(at)
                    f.flush()
                    os.fsync(f.fileno())
                break
            header, hlen, plen = checked
            start = at + _HEAD.size
            payload = view[start + hlen : start + hlen + plen]
            key = put_key(header)
            ids = header.get("i") or ()
            if (group and (key is None or key != group_key or len(group_ids) >= _MERGE_ROWS
                           or group_bytes >= _MERGE_BYTES or not group_ids.isdisjoint(ids)
                           or len(set(ids)) != len(ids))):
                flush()
            if not group:
                group_at, group_key, group_ids, group_bytes = at, key, set(), 0
            group.append((header, payload))
            group_ids.update(ids)
            group_bytes += plen
            if key is None:
                flush()
            self.records_since_snapshot += 1
            self.bytes_since_snapshot += _HEAD.size + hlen + plen
            at = start + hlen + plen
        flush()

    @staticmethod
    def _check_record(view: memoryview, at: int) -> tuple[dict[str, Any], int, int] | str:
        """The record at ``at`` (header, header length, payload length), or what is wrong."""
        if at + _HEAD.size > len(view):
            return "a cut record header"
        magic, hlen, plen, crc = _HEAD.unpack_from(view, at)
        if magic != MAGIC:
            return "no record magic"
        end = at + _HEAD.size + hlen + plen
        if end > len(view):
            return "a cut record"
        body = view[at + _HEAD.size : end]
        if zlib.crc32(body) != crc:
            return "a checksum mismatch"
        try:
            header = json.loads(bytes(body[:hlen]))
        except ValueError:
            return "a header that is not JSON"
        if not isinstance(header, dict):
            return "a header that is not an object"
        return header, hlen, plen

    # ------------------------------------------------------------------ appending
    def _open_segment(self, seq: int) -> None:
        path = self.root / segment_name(seq)
        self._fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        self.seq = seq
        if self.sync != "off":
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def check_usable(self) -> None:
        if self.failed is not None:
            raise JournalError(
                f"the journal at {str(self.root)!r} failed ({self.failed}); the store takes no "
                "more writes (reopen it from the journal)"
            ) from self.failed

    def append(self, header: dict[str, Any], buffers: Sequence[memoryview] = ()) -> int:
        """Write one record (call under the store's lock); a ticket for ``commit``."""
        self.check_usable()
        try:
            text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as err:
            raise JournalError(f"the journal cannot hold this {header.get('o')!r} call: {err}") from None
        text += b" " * (-(_HEAD.size + len(text)) % _ALIGN)
        pieces: list[Any] = [b"", text]
        crc = zlib.crc32(text)
        plen = 0
        for buf in buffers:
            pieces.append(buf)
            crc = zlib.crc32(buf, crc)
            pad = -len(buf) % _ALIGN
            if pad:
                pieces.append(_PAD[:pad])
                crc = zlib.crc32(_PAD[:pad], crc)
            plen += len(buf) + pad
        pieces[0] = _HEAD.pack(MAGIC, len(text), plen, crc)
        try:
            _writev_all(self._fd, pieces)  # type: ignore[arg-type]
            if self.sync == "always":
                os.fdatasync(self._fd)  # type: ignore[arg-type]
        except OSError as err:
            self.failed = err
            raise JournalError(f"journal write to {str(self.root)!r} failed: {err}") from err
        total = _HEAD.size + len(text) + plen
        self._written += total
        if self.sync == "always":
            self._synced = self._written
        self.bytes_since_snapshot += total
        self.records_since_snapshot += 1
        return self._written

    def commit(self, ticket: int) -> None:
        """Return once the record ``ticket`` names is on disk (``batch``: group commit; call
        without holding the store's lock, so other writers keep appending meanwhile)."""
        if self.sync != "batch":
            return
        with self._cond:
            while self._synced < ticket:
                if self._syncing:
                    self._cond.wait()
                    continue
                self.check_usable()
                self._syncing = True
                target, fd = self._written, self._fd
                self._cond.release()
                try:
                    os.fdatasync(fd)  # type: ignore[arg-type]
                except OSError as err:
                    self.failed = err
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    self._cond.notify_all()
                if self.failed is not None:
                    self.check_usable()
                self._synced = max(self._synced, target)

    @property
    def due(self) -> bool:
        return not self._compacting and (
            self.bytes_since_snapshot >= self.compact_bytes
            or self.records_since_snapshot >= self.compact_records
        )

    # ------------------------------------------------------------------ compaction
    def cut(self) -> int | None:
        """Start a new segment (call under the store's lock): what follows is after the
        snapshot about to be taken. None when a compaction is already running."""
        if self._compacting:
            return None
        self.check_usable()
        self._compacting = True
        with self._cond:
            while self._syncing:
                self._cond.wait()
            old = self._fd
            try:
                if self.sync != "off":
                    os.fdatasync(old)  # type: ignore[arg-type]
                self._synced = self._written
                self._open_segment(self.seq + 1)
            except OSError as err:
                self._compacting = False
                self.failed = err
                raise JournalError(f"journal rotation in {str(self.root)!r} failed: {err}") from err
            os.close(old)  # type: ignore[arg-type]
        self.bytes_since_snapshot = 0
        self.records_since_snapshot = 0
        return self.seq

    def write_snapshot(self, snaps: list[PartitionSnapshot], next_segment: int) -> None:
        """Write the snapshot cut at ``next_segment`` (outside the store's lock), then remove
        the segments it replaces."""
        try:
            save_store(_SnapshotOf(snaps), self.root / SNAPSHOT,
                       metadata={"journal": {"next_segment": next_segment}}, private=True)
            for p in self.root.iterdir():
                m = _SEGMENT.match(p.name)
                if m and int(m.group(1)) < next_segment:
                    p.unlink()
        finally:
            self._compacting = False

    def write_snapshot_failed(self) -> None:
        """The copy for a snapshot failed after ``cut``: the segments stay, nothing is lost."""
        self._compacting = False

    def close(self) -> None:
        with self._cond:
            while self._syncing:
                self._cond.wait()
            if self._fd is not None:
                try:
                    if self.sync != "off" and self.failed is None:
                        os.fdatasync(self._fd)
                finally:
                    os.close(self._fd)
                    self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None  # type: ignore[assignment]


def checked_tags_for_journal(tag_rows: list[dict[str, Any]] | None) -> None:
    """Tags must come back from JSON as they went in (the checkpoint's rule)."""
    if tag_rows is None:
        return
    for i, row in enumerate(tag_rows):
        check_tag_value(row, f"put_samples: tags[{i}] (journaled)")


def quiet(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with the store's warnings silenced (a replayed no-op clear warns again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn()
