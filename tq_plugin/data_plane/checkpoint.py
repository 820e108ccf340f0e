"""Safe checkpoints of a data-plane store: tensors in safetensors, metadata in JSON, no pickle.

``LocalDataPlane.save`` / ``load`` (and the Ray store's, run in its actor) go through here, and
``load_into`` puts a checkpoint into any ``DataPlaneClient``. A store that can be saved exposes
``snapshot_partitions()`` (a consistent copy of every partition as ``PartitionSnapshot``s); a
store that keeps claims defines ``restore_claims(partition_id, claimed)`` on its class. Nothing here reaches
into a store's private state.

A checkpoint is a directory::

    manifest.json      format version; per partition its schema, live sample ids in first-put
                       order, tags, claims, each field's kind/dtype/shape and the sha256 of
                       the partition's tensor file
    manifest.sha256    sha256 of manifest.json (written last: its presence marks a complete dir)
    <i>.safetensors    partition i: per field, the rows holding it and their data (dense:
                       ``[rows, *shape]``; jagged: ``values`` + per-row ``lengths``)

Loading parses nothing but JSON and safetensors, so a checkpoint can never run code. Each file
is read once into memory and the digest is checked over the same bytes that are parsed, so a
truncated, corrupted or half-copied checkpoint is rejected before a single row is put. The
digests verify integrity, not authenticity: whoever can write the directory can rewrite the
digests too (see SECURITY.md).

Saving is crash-safe: the new checkpoint is written and fsynced under ``<path>.tmp-<uuid>``,
the old one is renamed to ``<path>.old-<uuid>``, the new one renamed in, the old one removed.
A crash at any point leaves ``<path>`` complete, or (between the two renames) no ``<path>``
and a complete ``<path>.old-*``, which ``read_checkpoint`` falls back to.

Loading rebuilds the store through ``register_partition`` and ``put_samples``, so every row is
revalidated by the same rules as a live put.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import _TYPES as _SAFETENSORS_DTYPES
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.jagged import nested_from_lengths
from tq_plugin.data_plane.rows import gather_rows

FORMAT = "tq_plugin.local_store"
# Bumped by every change to what ``save_store`` writes: tests/data/store_checkpoint/v<N>/ holds
# a checkpoint of each version, and the tests load every one (test_checkpoint_format.py).
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest.sha256"
_SHOW = 5  # how many problems or ids an error names

# Only these dtypes are ever built from a manifest's dtype string (never getattr(torch, name)).
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in _SAFETENSORS_DTYPES.values()
}


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or of an unknown format."""


# ---------------------------------------------------------------------- manifest schema
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _FieldEntry(_Strict):
    name: str
    kind: Literal["dense", "jagged"]
    dtype: str
    shape: list[int]  # dense: per row; jagged: per element


class _PartitionEntry(_Strict):
    partition_id: str
    sha256: str
    declared: list[str]
    jagged: list[str]
    num_samples: int | None
    consumer_tasks: list[str]
    grpo_group_size: int | None
    enums: dict[str, list[str]]
    sample_ids: list[str]  # live rows, first-put order
    tags: dict[str, dict[str, Any]]
    consumed: dict[str, list[str]]
    fields: list[_FieldEntry]


class _Manifest(_Strict):
    format: Literal["tq_plugin.local_store"]
    format_version: int
    partitions: list[_PartitionEntry]
    metadata: dict[str, Any]  # the caller's, e.g. the Lightning callback's in-flight step meta


class Restored(NamedTuple):
    """What ``load_into`` put back: the partitions, and the metadata saved with them."""

    partition_ids: list[str]
    metadata: dict[str, Any]


# ---------------------------------------------------------------------- snapshot (save side)
@dataclass
class PartitionSnapshot:
    """One partition, copied: ``entry`` (its schema, live ids in first-put order, tags, claims,
    its fields' kinds, dtypes and shapes: the manifest's partition entry, less the digest) and
    ``tensors`` (per field ``<i>.rows`` and ``<i>.data``, or ``<i>.values`` + ``<i>.lengths``)."""

    entry: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class Checkpointable(Protocol):
    """What ``save_store`` needs of a store: a consistent copy of every partition."""

    def snapshot_partitions(self) -> list[PartitionSnapshot]: ...


def _file_of(index: int) -> str:
    return f"{index}.safetensors"


def check_tag_value(value: Any, where: str) -> None:
    """Refuse a tag (or metadata) value JSON would not carry back as it went in."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}; a checkpoint stores finite floats only")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_tag_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a non-string key {key!r}; JSON keys are strings")
            check_tag_value(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; a checkpoint stores tags made of str, int, "
        "float, bool, None, lists and str-keyed dicts only (it would not come back as it went in)"
    )


def _validate_tags(snap: PartitionSnapshot) -> None:
    pid = snap.entry["partition_id"]
    for sid, tags in snap.entry["tags"].items():
        for key, value in tags.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"save: tag key {key!r} of sample {sid!r} in partition {pid!r} is not a string"
                )
            check_tag_value(value, f"save: tag {key!r} of sample {sid!r} in partition {pid!r}")


# ---------------------------------------------------------------------- files
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes, mode: int = 0o666) -> None:
    with open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _siblings(path: Path, kind: str) -> list[Path]:
    """``<path>.<kind>-<uuid>`` entries beside ``path`` (no glob: the name may hold ``[``)."""
    prefix = f"{path.name}.{kind}-"
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))


def save_store(
    store: Checkpointable,
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, Any] | None = None,
    private: bool = False,
) -> None:
    """Write ``store`` to the directory ``path``, replacing an existing checkpoint atomically.

    The store copies itself (``snapshot_partitions``: under its lock, a consistent cut with no
    put half in it), then the copy is written without holding the lock. ``metadata`` (JSON primitives) is kept in the manifest and handed
    back by ``load_into``. A tag or metadata value that JSON cannot carry faithfully raises
    before anything is written. One writer per ``path`` at a time. ``private``: the directory
    is the owner's only (0700, files 0600; the store's journal snapshots).
    """
    meta = dict(metadata or {})
    check_tag_value(meta, "save: metadata")
    target = Path(path)
    if target.exists() and not (target / MANIFEST_DIGEST).is_file() and (
        not target.is_dir() or any(target.iterdir())
    ):
        raise CheckpointError(
            f"save: {str(target)!r} exists and is not a checkpoint; refusing to replace it"
        )
    snaps = store.snapshot_partitions()
    for snap in snaps:
        _validate_tags(snap)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in _siblings(target, "tmp"):  # left by a crashed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex}")
    mode = 0o600 if private else 0o666  # 0o666: the umask decides, as open() does
    tmp.mkdir(mode=0o700 if private else 0o777)
    try:
        entries = []
        for index, snap in enumerate(snaps):
            blob = _st_save(snap.tensors, metadata={"partition_id": snap.entry["partition_id"]})
            _write_synced(tmp / _file_of(index), blob, mode)
            entries.append({**snap.entry, "sha256": _sha256(blob)})
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "partitions": entries,
                    "metadata": meta}
        text = json.dumps(manifest, sort_keys=True, allow_nan=False).encode()
        _write_synced(tmp / MANIFEST, text, mode)
        _write_synced(tmp / MANIFEST_DIGEST, _sha256(text).encode(), mode)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_in(tmp, target)


def _swap_in(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex}")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    # The new checkpoint is durable: earlier leftovers (this swap's or a crashed one's) can go.
    for leftover in _siblings(target, "old"):
        shutil.rmtree(leftover, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- read + validate
@dataclass
class _LoadedPartition:
    entry: _PartitionEntry
    tensors: dict[str, torch.Tensor]


def _resolve(path: Path) -> Path:
    if path.is_dir():
        return path
    # A crash between the two renames of a save leaves the old checkpoint aside, complete.
    aside = [p for p in _siblings(path, "old") if (p / MANIFEST_DIGEST).is_file()]
    if aside:
        return aside[-1]
    raise CheckpointError(f"no checkpoint directory at {str(path)!r}")


def _read(path: Path, rule: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing ({rule})") from None


def _parse_manifest(root: Path) -> _Manifest:
    digest = _read(root / MANIFEST_DIGEST, "written last: the checkpoint is incomplete")
    text = _read(root / MANIFEST, "every checkpoint has one")
    if _sha256(text) != digest.decode(errors="replace").strip():
        raise CheckpointError(
            f"checkpoint file {str(root / MANIFEST)!r} does not match its sha256 in "
            f"{MANIFEST_DIGEST}: it is truncated, corrupted or was modified"
        )
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise CheckpointError(
            f"checkpoint file {str(root / MANIFEST)!r} is not JSON: {err}"
        ) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"{str(root / MANIFEST)!r} is not a {FORMAT} checkpoint manifest")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{str(root / MANIFEST)!r} has format_version {version!r}; this version of "
            f"tq_plugin reads format_version {FORMAT_VERSION} only"
        )
    try:
        return _Manifest.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:_SHOW]
        )
        raise CheckpointError(f"{str(root / MANIFEST)!r} is malformed: {problems}") from None


def _expect(cond: bool, file: Path, message: str) -> None:
    if not cond:
        raise CheckpointError(f"checkpoint file {str(file)!r}: {message}")


def _check_partition(entry: _PartitionEntry, tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Every name the manifest gives must match the tensors, and nothing else may be there."""
    pid = entry.partition_id
    n = len(entry.sample_ids)
    ids = set(entry.sample_ids)
    _expect(len(ids) == n, file, f"partition {pid!r} lists a sample id twice")
    unknown_tags = [s for s in entry.tags if s not in ids]
    _expect(not unknown_tags, file,
            f"tags name rows that are not in partition {pid!r}: {unknown_tags[:_SHOW]}")
    for task, claimed in entry.consumed.items():
        stray = [s for s in claimed if s not in ids]
        _expect(not stray, file,
                f"task {task!r} claimed rows not in partition {pid!r}: {stray[:_SHOW]}")
    expected: set[str] = set()
    for i, f in enumerate(entry.fields):
        where = f"field {f.name!r} of partition {pid!r}"
        dtype = _DTYPES.get(f.dtype)
        _expect(dtype is not None, file, f"{where} has unsupported dtype {f.dtype!r}")
        _expect(all(d >= 0 for d in f.shape), file, f"{where} has a negative dim in {f.shape}")
        parts = ("rows", "values", "lengths") if f.kind == "jagged" else ("rows", "data")
        names = [f"{i}.{p}" for p in parts]
        expected.update(names)
        missing = [k for k in names if k not in tensors]
        _expect(not missing, file,
                f"{where}: the manifest names tensors {missing} it does not hold")
        rows = tensors[names[0]]
        _expect(rows.dtype == torch.int64 and rows.dim() == 1, file,
                f"{where}: rows must be int64 [k]")
        k = rows.shape[0]
        rows_np = rows.numpy()
        _expect(
            bool(((rows_np >= 0) & (rows_np < n)).all()) and np.unique(rows_np).shape[0] == k,
            file,
            f"{where}: row indices must be distinct and name rows of the partition's {n} ids",
        )
        if f.kind == "dense":
            data = tensors[names[1]]
            _expect(data.dtype == dtype, file,
                    f"{where}: data is {data.dtype}, manifest says {f.dtype}")
            _expect(
                tuple(data.shape) == (k, *f.shape),
                file,
                f"{where}: data has shape {tuple(data.shape)}, manifest says {(k, *f.shape)}",
            )
        else:
            values, lengths = tensors[names[1]], tensors[names[2]]
            _expect(values.dtype == dtype, file,
                    f"{where}: values are {values.dtype}, manifest says {f.dtype}")
            _expect(
                values.dim() == 1 + len(f.shape) and tuple(values.shape[1:]) == tuple(f.shape),
                file,
                f"{where}: values have shape {tuple(values.shape)}, manifest says [*, {f.shape}]",
            )
            _expect(
                lengths.dtype == torch.int64 and tuple(lengths.shape) == (k,),
                file,
                f"{where}: lengths must be int64 [{k}]",
            )
            _expect(
                bool((lengths >= 0).all()) and int(lengths.sum()) == values.shape[0],
                file,
                f"{where}: lengths must be >= 0 and sum to the {values.shape[0]} values held",
            )
    extra = sorted(set(tensors) - expected)
    _expect(not extra, file, f"holds tensors the manifest does not name: {extra[:_SHOW]}")


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[list[_LoadedPartition], dict[str, Any]]:
    """Read and fully validate a checkpoint; raise ``CheckpointError`` naming the file and rule."""
    root = _resolve(Path(path))
    manifest = _parse_manifest(root)
    seen = [p.partition_id for p in manifest.partitions]
    if len(set(seen)) != len(seen):
        raise CheckpointError(f"{str(root / MANIFEST)!r} lists a partition twice")
    out = []
    for index, entry in enumerate(manifest.partitions):
        file = root / _file_of(index)
        blob = _read(file, f"partition {entry.partition_id!r} keeps its tensors there")
        if _sha256(blob) != entry.sha256:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} does not match its sha256 in {MANIFEST}: "
                "it is truncated, corrupted or was modified"
            )
        try:
            tensors = _st_load(blob)
        except SafetensorError as err:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is not a valid safetensors file: {err}"
            ) from None
        _check_partition(entry, tensors, file)
        out.append(_LoadedPartition(entry, tensors))
    return out, manifest.metadata


# ---------------------------------------------------------------------- restore (load side)
def _row_groups(lp: _LoadedPartition) -> list[tuple[list[str], dict[str, torch.Tensor]]]:
    """Rows grouped by the set of fields they hold, each group with its fields' payloads.

    One put per group lands each row whole (in the common case, one put for the partition).
    """
    e, tensors = lp.entry, lp.tensors
    n = len(e.sample_ids)
    rows = [tensors[f"{i}.rows"].numpy() for i in range(len(e.fields))]
    holds = np.zeros((n, len(e.fields)), dtype=bool)
    for i, r in enumerate(rows):
        holds[r, i] = True
    groups: list[tuple[list[str], dict[str, torch.Tensor]]] = []
    if not n or not e.fields:
        return groups
    signatures, inverse = np.unique(holds, axis=0, return_inverse=True)
    for g, signature in enumerate(signatures):
        members = np.flatnonzero(inverse.reshape(-1) == g)
        if not signature.any():
            continue
        fields: dict[str, torch.Tensor] = {}
        for i in np.flatnonzero(signature).tolist():
            f = e.fields[i]
            order = np.argsort(rows[i], kind="stable")
            pos = order[np.searchsorted(rows[i], members, sorter=order)]
            if f.kind == "dense":
                fields[f.name] = tensors[f"{i}.data"][torch.from_numpy(pos)]
                continue
            lengths = tensors[f"{i}.lengths"].numpy()
            starts = np.cumsum(lengths) - lengths
            values = gather_rows(tensors[f"{i}.values"], starts[pos], lengths[pos])
            fields[f.name] = nested_from_lengths(values, torch.from_numpy(lengths[pos]))
        groups.append(([e.sample_ids[r] for r in members.tolist()], fields))
    return groups


def load_into(client: Any, path: str | os.PathLike[str]) -> Restored:
    """Put a checkpoint's partitions into ``client`` (any ``DataPlaneClient``).

    The whole checkpoint is validated before the first write. Rows are re-put in first-put
    order (so claims keep their order), each row's fields in one put, revalidated by
    ``put_samples``; rows with the same
    id are overwritten, other rows of the client are left alone. Claims are restored when the
    client keeps them (``restore_claims``: ``LocalDataPlane``, the Ray store's actor); another
    backend gets the rows and a warning.
    """
    loaded, metadata = read_checkpoint(path)
    for lp in loaded:
        e = lp.entry
        call_dp(
            client,
            "register_partition",
            partition_id=e.partition_id,
            fields=e.declared,
            num_samples=e.num_samples,
            consumer_tasks=e.consumer_tasks or None,
            grpo_group_size=e.grpo_group_size,
            enums=e.enums or None,
            jagged_fields=e.jagged or None,
        )
        if e.sample_ids:
            tags = [e.tags.get(s, {}) for s in e.sample_ids]
            call_dp(client, "put_samples", sample_ids=e.sample_ids, partition_id=e.partition_id,
                    fields=None, tags=tags)
        for ids, fields in _row_groups(lp):
            call_dp(client, "put_samples", sample_ids=ids, partition_id=e.partition_id,
                    fields=fields)
        claimed = {t: c for t, c in e.consumed.items() if c}
        if not claimed:
            continue
        # The store's own class must keep claims: a wrapper that forwards attributes (a metered
        # or proxy client) is not the store, and gets the warning.
        if callable(getattr(type(client), "restore_claims", None)):
            client.restore_claims(e.partition_id, claimed)
        else:
            warnings.warn(
                f"load: claims of partition {e.partition_id!r} are not restored into a "
                f"{type(client).__name__} (only LocalDataPlane keeps them); its tasks will "
                "claim those rows again",
                RuntimeWarning,
                stacklevel=2,
            )
    return Restored([lp.entry.partition_id for lp in loaded], metadata)
