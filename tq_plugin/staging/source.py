"""``TQTokenSource``: the trainer-side ``StagingSource`` over ``get_samples``.

Every read is one batched ``get_samples`` in request order. Jagged columns are split by
their offsets once per batch (never a nested-tensor index per row), and each row becomes a
normally validated base snapshot whose digest is recomputed over the exact int64 / float32
values read (once, over the arrays: ``validated_snapshot``). A missing, duplicate or
mismatched row raises ``KeyError``: the finalizer maps it to a placeholder, never a silent
short read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor

from tq_plugin.data_plane import (
    ROUTE_ENCODING_LIST,
    ROUTE_ENCODING_NONE,
    ROUTED_EXPERTS_ENCODING_FIELD,
    ROUTED_EXPERTS_FIELD,
    ROUTED_EXTRAS_METADATA_FIELD,
    ROUTED_LEN_FIELD,
)
from tq_plugin.staging._gym import gym_record_class
from tq_plugin.staging.digest import (
    EMPTY_EXTRAS_DIGEST,
    checked_column_bytes,
    compute_extras_digest,
    digest_of_checked_row,
)
from tq_plugin.staging.media import (
    MEDIA_HAS_FRAMES_FIELD,
    MEDIA_IMGS_FIELD,
    MEDIA_IMGS_SIZES_FIELD,
    MEDIA_METADATA_DIGEST_FIELD,
    MEDIA_METADATA_FIELDS,
    MEDIA_NUM_FRAMES_FIELD,
    MEDIA_PATCH_SIZE_FIELD,
    MEDIA_PRESENT_FIELD,
    MEDIA_READ_FIELDS,
    MediaMetadataIntegrityError,
    StagedMediaTensors,
    media_from_row,
)
from tq_plugin.staging.records import (
    TOKEN_VERSIONS,
    StagedCallBaseSnapshot,
    checked_snapshot,
    staging_key,
    validated_snapshot,
)
from tq_plugin.staging.store import (
    _CODE_TO_MODE,
    STAGING_FIELDS,
    TOKEN_IDS_DELTA_FIELD,
    TOKEN_VERSIONS_FIELD,
    TQStagingStore,
)

_DIGEST_HEX_FIELDS = (
    ("digest", "digest_bytes", None),
    ("extras_digest", "extras_digest_bytes", None),
    ("chain_hash", "chain_hash_bytes", "chain_hash_present"),
    ("cumulative_hash", "cumulative_hash_bytes", "cumulative_hash_present"),
)
_INT_FIELDS = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
)
_ROUTE_ENCODINGS = (ROUTE_ENCODING_NONE, 1, ROUTE_ENCODING_LIST)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class RouteFragment:
    """One call's staged routed-experts payload, carried beside (never inside) its snapshot.

    ``routes`` is ``[delta_len, num_layers, top_k]``. ``verify`` rebuilds the call's full
    extras from the metadata JSON plus the routes and checks them against the snapshot's
    ``extras_digest`` at the point of use.
    """

    routes: torch.Tensor
    encoding: int
    extras_metadata_json: bytes
    token_versions: tuple[int, ...] | None = None  # the call's ledger, when it has one

    def extras(self) -> dict[str, Any]:
        metadata = json.loads(self.extras_metadata_json.decode("utf-8"))
        ledger = {} if self.token_versions is None else {TOKEN_VERSIONS: list(self.token_versions)}
        return {**(metadata or {}), **ledger, ROUTED_EXPERTS_FIELD: self.routes.tolist()}

    def verify(self, extras_digest: str) -> None:
        if compute_extras_digest(self.extras()) != extras_digest:
            raise ValueError("routed_experts fragment does not match the call's extras_digest")


@dataclass(frozen=True)
class FetchedStagedCall:
    """One explicitly identified finalization fetch result.

    ``fragment`` is set only when route payloads were requested (direct mode); deferred
    finalization leaves route bytes in the store and carries only ``routed_len``.
    ``extras`` is the row's metadata (extras minus routes, its ledger put back); for a
    route-free call that is its whole extras, verified against the snapshot's
    ``extras_digest`` at fetch (calls with routes verify through ``RouteFragment.verify`` at
    the point of use). ``token_versions``: the call's per-token version ledger (one version
    per generated token), ``None`` for a call staged without one.
    """

    staging_key: str
    snapshot: Any
    routed_len: int
    fragment: RouteFragment | None = None
    extras: dict[str, Any] | None = None
    media_present: bool = False
    media_has_frames: bool = False
    token_versions: list[int] | None = None


def _jagged_values(value: torch.Tensor) -> torch.Tensor:
    """The flat values of a jagged nested tensor, what ``values()`` returns a view of.

    ``values()`` dispatches through Python (~16 us a call on torch 2.13, a few per row of a
    64-row batch), so the tensor it aliases is read directly where the layout has it.
    """
    flat = getattr(value, "_values", None)
    return flat if type(flat) is torch.Tensor else value.values()


def _nested(value: torch.Tensor) -> bool:
    """``value.is_nested``, without its Python dispatch for a jagged tensor."""
    return type(value) is NestedTensor or value.is_nested


class _Batch:
    """A batched read split into per-row values, one conversion per column.

    Each column is converted once (to numpy, or to Python lists) and then sliced per row, so
    per-row work is a few views and list conversions, never a nested-tensor index.
    """

    def __init__(self, td: TensorDictBase) -> None:
        self.td = td
        self.n = int(td.batch_size[0]) if len(td.batch_size) else 0
        self._cache: dict[tuple[str, str], Any] = {}

    def _column(self, name: str) -> torch.Tensor:
        value = self.td.get(name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"staged column {name!r} is {type(value).__name__}, not a tensor")
        return value

    def _split(self, name: str, convert: Any) -> list[Any]:
        value = self._column(name)
        if type(value) is NestedTensor and value._lengths is None:
            # The offsets and values it holds, read directly: its offsets() and values()
            # methods dispatch through Python (~15 us each on torch 2.13).
            bounds = value._offsets.tolist()
            values = convert(value._values)
            return [values[a:b] for a, b in itertools.pairwise(bounds)]
        if value.is_nested:
            bounds = value.offsets().tolist()
            values = convert(_jagged_values(value))
            return [values[a:b] for a, b in itertools.pairwise(bounds)]
        return list(convert(value))

    def flat(self, name: str) -> tuple[np.ndarray, list[int]] | None:
        """A column's values as one numpy array and its row bounds (a jagged column's offsets;
        every L values of a dense ``[N, L]`` one), or None for any other layout."""
        value = self._column(name)
        if type(value) is NestedTensor and value._lengths is None:
            return value._values.detach().cpu().numpy(), value._offsets.tolist()
        if _nested(value) or value.dim() != 2:
            return None
        width = value.shape[1]
        return value.detach().cpu().numpy().reshape(-1), list(range(0, self.n * width + 1, width))

    def token_columns(self) -> _TokenColumns | None:
        """The three digest-covered columns checked once for the whole batch (None: row by row)."""
        key = ("token_columns", "")
        if key not in self._cache:
            try:
                self._cache[key] = _TokenColumns(self)
            except (TypeError, ValueError, RuntimeError):  # row by row then names the fault
                self._cache[key] = None
        return self._cache[key]

    def rows(self, name: str) -> list[torch.Tensor]:
        """Each row as a tensor (jagged columns split by offsets; dense ones by row)."""
        key = ("rows", name)
        if key not in self._cache:
            self._cache[key] = self._split(name, lambda t: t)
        return self._cache[key]

    def arrays(self, name: str) -> list[np.ndarray]:
        """Each row as a numpy view (for numpy-representable dtypes)."""
        key = ("arrays", name)
        if key not in self._cache:
            self._cache[key] = self._split(name, lambda t: t.detach().cpu().numpy())
        return self._cache[key]

    def ints(self, name: str) -> list[int]:
        """One integer scalar per row, type-checked."""
        key = ("ints", name)
        if key not in self._cache:
            value = self._column(name)
            if _nested(value) or value.dtype not in _INT_DTYPES:
                raise TypeError(
                    f"staged scalar {name!r} must be an integer tensor, got {value.dtype}"
                )
            if value.numel() != self.n:
                raise ValueError(f"staged scalar {name!r} must hold one element per row")
            self._cache[key] = value.reshape(-1).tolist()
        return self._cache[key]

    def bools(self, name: str) -> list[bool]:
        """One bool flag per row, type-checked."""
        key = ("bools", name)
        if key not in self._cache:
            value = self._column(name)
            if _nested(value) or value.dtype != torch.bool:
                raise TypeError(f"staged flag {name!r} must be a bool tensor, got {value.dtype}")
            if value.numel() != self.n:
                raise ValueError(f"staged flag {name!r} must hold one element per row")
            self._cache[key] = value.reshape(-1).tolist()
        return self._cache[key]

    def identity(self) -> tuple[list[list[int]], list[int], list[bytes], list[bytes], list[bool]]:
        """The columns every row's snapshot reads, converted once per batch, in the order a
        row reads them: the integer fields, the capture mode code, rollout and call ids, and
        the parent flag (the parent ids and the digests follow, per row, as before)."""
        key = ("identity", "")
        if key not in self._cache:
            self._cache[key] = (
                [self.ints(name) for name in _INT_FIELDS],
                self.ints("capture_mode"),
                self.texts("rollout_id_utf8"),
                self.texts("model_call_id_utf8"),
                self.bools("parent_call_id_present"),
            )
        return self._cache[key]

    def texts(self, name: str) -> list[bytes]:
        """Each row of a uint8 column as bytes."""
        key = ("texts", name)
        if key not in self._cache:
            if self._column(name).dtype != torch.uint8:
                raise TypeError(f"staged byte column {name!r} must be uint8")
            self._cache[key] = [row.tobytes() for row in self.arrays(name)]
        return self._cache[key]


class _TokenColumns:
    """A batch's token columns checked against the digest's value rules, encoded big-endian and
    made lists once (``checked_column_bytes``), so a row's snapshot costs one hash over slices."""

    def __init__(self, batch: _Batch) -> None:
        names = (TOKEN_IDS_DELTA_FIELD, "token_mask_delta", "generation_logprobs_delta")
        ids, mask, logprobs = (batch.flat(name) for name in names)
        self.encoded = None
        if ids and mask and logprobs and ids[1] == mask[1] == logprobs[1]:
            self.bounds = ids[1]
            self.encoded = checked_column_bytes(ids[0], mask[0], logprobs[0])
        if self.encoded is not None:
            self.lists = (ids[0].tolist(), mask[0].tolist(), logprobs[0].tolist())

    def snapshot(self, cls: type[Any], fields: dict[str, Any], i: int) -> Any | None:
        """Row i's snapshot when its slices hash to the digest it carries (None otherwise: the
        row is then validated by itself, which names what is wrong)."""
        if self.encoded is None:
            return None
        a, b = self.bounds[i], self.bounds[i + 1]
        ids_raw, mask_raw, logprob_raw = self.encoded
        try:
            digest = digest_of_checked_row(
                fields, b - a, ids_raw[8 * a : 8 * b], mask_raw[4 * a : 4 * b],
                logprob_raw[4 * a : 4 * b],
            )
        except (TypeError, ValueError):
            return None
        ids, mask, logprobs = self.lists
        lists = {
            "token_ids_delta": ids[a:b],
            "token_mask_delta": mask[a:b],
            "generation_log_probs_delta": logprobs[a:b],
        }
        return checked_snapshot(cls, fields, lists, digest)


def _snapshot_fields(batch: _Batch, i: int) -> dict[str, Any]:
    """Row i's snapshot fields but its token columns (``_snapshot_columns``); digests must be
    32 bytes, ``parent`` decoded only when present."""
    ints, modes, rollout_ids, call_ids, parents = batch.identity()
    out: dict[str, Any] = {name: column[i] for name, column in zip(_INT_FIELDS, ints)}
    code = modes[i]
    if code not in _CODE_TO_MODE:
        raise ValueError(f"unknown capture_mode code {code}")
    out["mode"] = _CODE_TO_MODE[code]
    out["rollout_id"] = rollout_ids[i].decode("utf-8")
    out["model_call_id"] = call_ids[i].decode("utf-8")
    parent_present = parents[i]
    out["parent_call_id"] = (
        batch.texts("parent_call_id_utf8")[i].decode("utf-8") if parent_present else None
    )
    for attr, column, flag in _DIGEST_HEX_FIELDS:
        raw = batch.texts(column)[i]
        if len(raw) != 32:
            raise ValueError(f"staged {column!r} must be 32 bytes, got {len(raw)}")
        present = True if flag is None else batch.bools(flag)[i]
        out[attr] = raw.hex() if present else None
    return out


def _snapshot_columns(batch: _Batch, i: int) -> dict[str, np.ndarray]:
    """Row i's three digest-covered columns as the numpy arrays read (snapshot field names)."""
    return {
        "token_ids_delta": batch.arrays(TOKEN_IDS_DELTA_FIELD)[i],
        "token_mask_delta": batch.arrays("token_mask_delta")[i],
        "generation_log_probs_delta": batch.arrays("generation_logprobs_delta")[i],
    }


def _row_extras(batch: _Batch, i: int, *, verify_media: bool) -> dict[str, Any] | None:
    """Decode the row's metadata JSON, checking the media checksum first on media partitions."""
    metadata = batch.texts(ROUTED_EXTRAS_METADATA_FIELD)[i]
    if verify_media:
        if MEDIA_METADATA_DIGEST_FIELD not in batch.td:
            raise MediaMetadataIntegrityError("Missing media metadata checksum")
        checksum = batch.rows(MEDIA_METADATA_DIGEST_FIELD)[i]
        if (
            checksum.dtype != torch.uint8
            or checksum.numel() != 32
            or checksum.numpy().tobytes() != hashlib.sha256(metadata).digest()
        ):
            raise MediaMetadataIntegrityError("Media metadata checksum mismatch")
    value = json.loads(metadata.decode("utf-8"))
    if value is not None and not isinstance(value, dict):
        raise ValueError(
            f"staged extras metadata must be a JSON object or null, got {type(value).__name__}"
        )
    return value


def _row_ledger(batch: _Batch, i: int, key: str) -> list[int] | None:
    """Row i's version ledger as ints (None when it has none: an empty column row)."""
    if TOKEN_VERSIONS_FIELD not in batch.td:
        return None
    row = batch.rows(TOKEN_VERSIONS_FIELD)[i]
    if row.dtype != torch.int64:
        raise TypeError(f"staged {TOKEN_VERSIONS_FIELD!r} of {key!r} must be int64, got {row.dtype}")
    return row.reshape(-1).tolist() or None


class StagingReadError(KeyError):
    """A staged read whose outcome is unknown: the transport failed or the store came back short.

    A ``KeyError`` (as the source contract requires), but unlike the store's own
    ``KeyError`` for a missing row it says nothing about the rows: retry the read, never
    turn the rollout into a placeholder because of it.
    """


def _check_route_free_extras(extras: dict[str, Any] | None, extras_digest: str, key: str) -> None:
    """Without routes the metadata is the call's whole extras: it must match its digest."""
    expected = EMPTY_EXTRAS_DIGEST if extras is None else compute_extras_digest(extras)
    if expected != extras_digest:
        raise ValueError(f"staged extras of {key!r} do not match the call's extras_digest")


class TQTokenSource:
    """Gym ``StagingSource`` over ``get_samples``.

    Snapshots are built with ``snapshot_cls``: by default Gym's own
    ``StagedCallBaseSnapshot`` when ``nemo_gym`` is in use in this process (Gym's verifier
    checks the class), else ours. Route payloads never ride inside snapshots.
    """

    def __init__(
        self,
        dp_client: Any,
        *,
        staging_partition: str,
        capture_media: bool = False,
        snapshot_cls: type[Any] | None = None,
    ) -> None:
        self.store = TQStagingStore(dp_client, staging_partition=staging_partition)
        self.staging_partition = staging_partition
        self.capture_media = capture_media
        self.snapshot_cls = snapshot_cls

    def _snapshot_cls(self) -> type[Any]:
        return (
            self.snapshot_cls
            or gym_record_class("StagedCallBaseSnapshot")
            or StagedCallBaseSnapshot
        )

    def _read(self, keys: list[str], select: list[str], what: str) -> _Batch:
        try:
            td = self.store.get(keys, select_fields=select)
        except Exception as exc:
            error = KeyError if isinstance(exc, KeyError) else StagingReadError
            raise error(
                f"{what}: staged rows for {len(keys)} keys could not be fetched from "
                f"{self.staging_partition!r}: {type(exc).__name__}: {exc}"
            ) from exc
        batch = _Batch(td)
        if batch.n != len(keys):
            raise StagingReadError(
                f"{what}: staged rows missing: requested {len(keys)}, got {batch.n}"
            )
        return batch

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """Base snapshots only, one per key, in order (Gym ``StagingSource`` conformance)."""
        return [item.snapshot for item in self.fetch_for_finalization(staging_keys)]

    def fetch_prefix_token_ids(self, staging_keys: Sequence[str]) -> list[int]:
        """The chain's ``token_ids_delta`` concatenated in request order, as Python ints."""
        keys = list(staging_keys)
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise KeyError("prefix fetch: staging_keys contains duplicates")
        batch = self._read(keys, [TOKEN_IDS_DELTA_FIELD], "prefix fetch incomplete")
        value = batch.td.get(TOKEN_IDS_DELTA_FIELD)
        return (_jagged_values(value) if value.is_nested else value.reshape(-1)).tolist()

    def fetch_for_finalization(
        self, staging_keys: Sequence[str], *, include_route_fragments: bool = False
    ) -> list[FetchedStagedCall]:
        """Fetch the digest-covered base columns, plus route payloads when requested.

        Deferred mode (the default) never selects ``routed_experts``. Direct mode tries the
        route column in the same read; a store's field check is all-or-nothing per batch,
        so on failure the batch falls back to the base selection as a whole.
        """
        keys = list(staging_keys)
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise KeyError("finalization staging request contains duplicate keys")
        select = list(STAGING_FIELDS) + (MEDIA_METADATA_FIELDS if self.capture_media else [])
        batch = None
        if include_route_fragments:
            try:
                batch = self._read(keys, [*select, ROUTED_EXPERTS_FIELD], "finalization")
            except KeyError:
                batch = None
        if batch is None:
            batch = self._read(keys, select, "finalization")
        return [self._fetched(batch, i, key, include_route_fragments) for i, key in enumerate(keys)]

    def _fetched(self, batch: _Batch, i: int, key: str, with_routes: bool) -> FetchedStagedCall:
        cls, fields = self._snapshot_cls(), _snapshot_fields(batch, i)
        # Only our snapshot class (and its subclasses) takes a digest handed to it.
        ours = isinstance(cls, type) and issubclass(cls, StagedCallBaseSnapshot)
        columns = batch.token_columns() if ours else None
        snapshot = None if columns is None else columns.snapshot(cls, fields, i)
        if snapshot is None:
            snapshot = validated_snapshot(cls, fields, _snapshot_columns(batch, i))
        if staging_key(snapshot.rollout_id, snapshot.model_call_id) != key:
            raise KeyError(
                f"staged row identity mismatch: requested {key!r}, the row holds "
                f"{snapshot.rollout_id!r}/{snapshot.model_call_id!r}"
            )
        present = has_frames = False
        if self.capture_media:
            present = batch.bools(MEDIA_PRESENT_FIELD)[i]
            has_frames = batch.bools(MEDIA_HAS_FRAMES_FIELD)[i]
            if has_frames and not present:
                raise ValueError(f"staged row {key!r} has media frames but no media")
        encoding = batch.ints(ROUTED_EXPERTS_ENCODING_FIELD)[i]
        if encoding not in _ROUTE_ENCODINGS:
            raise ValueError(f"unknown routed_experts_encoding {encoding} in staged row {key!r}")
        ledger = _row_ledger(batch, i, key)
        fragment = self._route_fragment(batch, i, encoding, ledger) if with_routes else None
        extras = _row_extras(batch, i, verify_media=self.capture_media)
        if ledger is not None:
            extras = {**(extras or {}), TOKEN_VERSIONS: ledger}
        if encoding == ROUTE_ENCODING_NONE:
            _check_route_free_extras(extras, snapshot.extras_digest, key)
        return FetchedStagedCall(
            staging_key=key,
            snapshot=snapshot,
            routed_len=batch.ints(ROUTED_LEN_FIELD)[i],
            fragment=fragment,
            extras=extras,
            media_present=present,
            media_has_frames=has_frames,
            token_versions=ledger,
        )

    def fetch_token_versions(self, staging_keys: Sequence[str]) -> list[list[int] | None]:
        """Each call's per-token version ledger (one weight version per generated token; None
        for a call staged without one), in request order, verified: the ledger is part of the
        call's extras, whose digest the call's staging digest covers (routed calls' extras
        are checked here too)."""
        out = []
        for item in self.fetch_for_finalization(staging_keys, include_route_fragments=True):
            if item.fragment is not None:
                item.fragment.verify(item.snapshot.extras_digest)
            out.append(item.token_versions)
        return out

    def _route_fragment(self, batch: _Batch, i: int, encoding: int,
                        ledger: list[int] | None = None) -> RouteFragment | None:
        if encoding == ROUTE_ENCODING_NONE:
            return None
        if ROUTED_EXPERTS_FIELD not in batch.td:
            raise KeyError("staged row metadata names routed_experts but its field is absent")
        return RouteFragment(
            routes=batch.rows(ROUTED_EXPERTS_FIELD)[i],
            encoding=encoding,
            extras_metadata_json=batch.texts(ROUTED_EXTRAS_METADATA_FIELD)[i],
            token_versions=None if ledger is None else tuple(ledger),
        )

    def fetch_media(self, items: Sequence[FetchedStagedCall]) -> list[StagedMediaTensors]:
        """One batched read of the media columns for rows known to carry media, in order.

        Items come from ``fetch_for_finalization`` and must all have ``media_present`` and
        the same ``media_has_frames`` (a sentinel frame count would fail validation beside
        real ones). These checks run before any read; each row is re-validated after it.
        """
        if not self.capture_media:
            raise ValueError("media reads require a media-enabled staging source")
        items = list(items)
        if not items:
            return []
        if not all(item.media_present for item in items):
            raise ValueError("fetch_media only accepts rows with media_present=True")
        has_frames = {item.media_has_frames for item in items}
        if len(has_frames) != 1:
            raise ValueError("fetch_media requires uniform media_has_frames")
        keys = [item.staging_key for item in items]
        if len(set(keys)) != len(keys):
            raise KeyError("media fetch contains duplicate keys")
        batch = self._read(keys, MEDIA_READ_FIELDS, "media fetch")
        frames = has_frames.pop()
        patch_sizes = batch.ints(MEDIA_PATCH_SIZE_FIELD)
        return [
            media_from_row(
                batch.rows(MEDIA_IMGS_FIELD)[i],
                batch.rows(MEDIA_IMGS_SIZES_FIELD)[i],
                batch.rows(MEDIA_NUM_FRAMES_FIELD)[i] if frames else None,
                patch_sizes[i],
            )
            for i in range(len(keys))
        ]
