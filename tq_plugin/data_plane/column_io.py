"""Column I/O between trainer code and the data plane: first write, write-back, padded reads.

Per-token columns live jagged on the wire (one row of exactly ``input_lengths[i]`` elements), so
padding is paid only when a consumer materializes a read, and always to one pad target per step
(``extra_info[GLOBAL_FORWARD_PAD_SEQLEN]``), so every data-parallel rank sees the same dim 1.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane.client import accepts_put_mode, call_dp
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.schema import (
    DP_TRAIN_FIELDS,
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_LENGTHS,
    PAD_TO_MULTIPLE,
    SAMPLE_MASK,
    TOKEN_ALIGNED_FIELDS,
    Layout,
)

# torch 2.13's nested_tensor_from_jagged logs a warning meant for fx/export tracing on its first
# call, outside any tracing. Drop exactly that record; every other torch.fx message still shows.
logging.getLogger("torch.fx._symbolic_trace").addFilter(
    lambda record: "is_fx_tracing will return true" not in record.getMessage()
)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``; ``value`` itself when multiple <= 1."""
    if multiple <= 1:
        return int(value)
    return -(-int(value) // int(multiple)) * int(multiple)


def _name_some(items: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _int_arg(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``: ``TypeError`` when not an int, ``ValueError`` below."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def _lengths_tensor(where: str, name: str, lengths: Any, n: int) -> torch.Tensor:
    """Row lengths as an int64 ``[n]`` CPU tensor, checked in whole-tensor ops.

    ``TypeError`` when ``lengths`` is not a dense integer tensor (or a list of ints);
    ``ValueError`` for a shape other than ``[n]`` or a negative length (naming the rows).
    """
    if isinstance(lengths, torch.Tensor):
        if lengths.is_nested:
            raise TypeError(
                f"{where}: {name!r} must be a dense [N] integer tensor, got a nested one"
            )
        t = lengths
    else:
        if not isinstance(lengths, Sequence) or not set(map(type, lengths)) <= {int}:
            raise TypeError(f"{where}: {name!r} must be a list of ints or an integer tensor")
        t = torch.tensor(lengths, dtype=torch.int64)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{where}: {name!r} must have an integer dtype, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{where}: {name!r} must have shape [{n}], got {tuple(t.shape)}")
    t = t.to(device="cpu", dtype=torch.int64)
    negative = torch.nonzero(t < 0).flatten()
    if negative.numel():
        rows = negative[:5].tolist()
        raise ValueError(
            f"{where}: {name!r} must be non-negative: rows {rows} have lengths "
            f"{t[negative[:5]].tolist()}"
        )
    return t


def nested_from_lengths(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A ``torch.jagged`` nested tensor over ``values`` whose row i has ``lengths[i]`` elements."""
    offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(lengths.to(device=values.device, dtype=torch.int64), 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def jaggedize(name: str, padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Cut each row of a padded ``[N, S, ...]`` column to its own length, in one masked select.

    Trailing padding beyond a row's length is dropped (that is what padding is); a column
    shorter than the longest row would lose real tokens, so it is an error, never a truncation.
    ``ValueError`` for a shape other than ``[N, S, ...]``, a column narrower than the longest
    row, or a negative length.
    """
    n = lengths.shape[0]
    if padded.dim() < 2 or padded.shape[0] != n:
        raise ValueError(
            f"field {name!r}: a per-token column must be [N={n}, S, ...], got {tuple(padded.shape)}"
        )
    if n and int(lengths.min()) < 0:
        raise ValueError(f"field {name!r}: row lengths must be non-negative")
    longest = int(lengths.max()) if n else 0
    if padded.shape[1] < longest:
        raise ValueError(
            f"field {name!r}: dim 1 is {padded.shape[1]} but the longest row has {longest} tokens; "
            "refusing to truncate"
        )
    lengths = lengths.to(padded.device)
    mask = torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]
    return nested_from_lengths(padded[mask], lengths)


def _row_lengths(nt: torch.Tensor) -> torch.Tensor:
    return nt.offsets().diff() if nt._lengths is None else nt._lengths  # type: ignore[attr-defined]


def payload_bytes(fields: Mapping[str, Any] | TensorDictBase | None) -> int:
    """Bytes of tensor payload in ``fields``: a jagged column counts its values buffer only."""
    if fields is None:
        return 0
    total = 0
    for value in fields.values():
        if isinstance(value, torch.Tensor):
            buf = value._values if value.is_nested else value  # type: ignore[attr-defined]
            total += buf.numel() * buf.element_size()
    return total


def _check_fields(where: str, fields: Any) -> None:
    if not isinstance(fields, (Mapping, TensorDictBase)):
        raise TypeError(
            f"{where}: fields must be a dict or TensorDict of tensors, got {type(fields).__name__}"
        )


def to_wire_columns(
    fields: Mapping[str, Any] | TensorDictBase, lengths: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Validate a write's columns and jaggedize per-token ones to the rows' lengths.

    ``TypeError`` for a field that is not a tensor, or a nested tensor that is not
    ``torch.jagged``; ``ValueError`` for a jagged per-token column whose row lengths differ
    from ``lengths`` or a padded one narrower than its longest row. Checks every field before
    returning, so a caller that writes only after this returns writes nothing on bad input.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in fields.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"field {name!r} is {type(value).__name__}; write tensors "
                "(dense or torch.jagged nested) and put primitives in tags"
            )
        per_token = name in TOKEN_ALIGNED_FIELDS and lengths is not None
        if value.is_nested:
            if value.layout != torch.jagged:
                raise TypeError(
                    f"field {name!r}: nested tensors must be torch.jagged "
                    "(build them with nested_from_lengths), not strided"
                )
            if per_token:
                got = _row_lengths(value).cpu()
                if got.shape != lengths.shape or not torch.equal(got, lengths.cpu()):  # type: ignore[union-attr]
                    raise ValueError(
                        f"field {name!r}: jagged row lengths differ from the meta's "
                        "sequence_lengths"
                    )
            out[name] = value
        elif per_token and value.dim() >= 2:
            out[name] = jaggedize(name, value, lengths)  # type: ignore[arg-type]
        else:
            out[name] = value
    return out


def first_write(
    batch: Mapping[str, Any] | TensorDictBase,
    *,
    sample_ids: Sequence[str],
    client: Any,
    partition_id: str,
    extra_info: Mapping[str, Any] | None = None,
    task_name: str = "train",
    pad_to_multiple: int = 1,
    tags: Sequence[Mapping[str, Any]] | None = None,
    overwrite: bool = False,
) -> KVBatchMeta:
    """The rollout's one flat put; returns the meta every later step of the iteration uses.

    ``batch[SAMPLE_MASK]`` is the batch-size oracle and ``batch[INPUT_LENGTHS]`` the row lengths;
    per-token columns may come jagged or padded. The keys minted here are the only keys: every
    later write-back lands under them, so ids already in the partition are refused unless
    ``overwrite=True`` (an older meta would otherwise read rows whose lengths changed under it).

    Everything is checked before the one put, and the put is atomic, so a rejected call
    writes nothing. Raises:

    * ``TypeError``: ``batch`` not a mapping, a column not a tensor, ``input_lengths`` not an
      integer tensor, ``sample_ids`` not a list of str, a tag not a dict, a non-int
      ``pad_to_multiple``, a non-str ``partition_id`` / ``task_name``;
    * ``ValueError``: a missing ``sample_mask`` / ``input_lengths``, an empty batch, counts of
      ``sample_ids`` / ``tags`` / ``input_lengths`` other than the batch's rows, duplicate or
      (without ``overwrite``) existing sample ids, a negative length, a per-token column that
      disagrees with ``input_lengths`` or would be truncated, ``pad_to_multiple < 1``; and
      whatever the store raises for its schema (its ``ValueError`` / ``TypeError``).
    """
    where = "first_write"
    if not isinstance(batch, (Mapping, TensorDictBase)):
        raise TypeError(f"{where}: batch must be a dict or TensorDict, got {type(batch).__name__}")
    if not isinstance(partition_id, str) or not isinstance(task_name, str):
        raise TypeError(f"{where}: partition_id and task_name must be str")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise TypeError(f"{where}: extra_info must be a dict, got {type(extra_info).__name__}")
    pad_to_multiple = _int_arg(where, "pad_to_multiple", pad_to_multiple, 1)
    for required in (SAMPLE_MASK, INPUT_LENGTHS):
        if required not in batch.keys():  # noqa: SIM118  (a TensorDict has no `in`)
            raise ValueError(f"{where}: the batch needs a {required!r} column")
    mask = batch[SAMPLE_MASK]
    if not isinstance(mask, torch.Tensor) or mask.dim() < 1:
        raise TypeError(f"{where}: {SAMPLE_MASK!r} must be a tensor with a row dim")
    n = int(mask.shape[0]) if not mask.is_nested else int(mask.size(0))
    if n == 0:
        raise ValueError(f"{where}: the batch is empty")
    if isinstance(sample_ids, (str, bytes)) or not isinstance(sample_ids, Sequence):
        raise TypeError(
            f"{where}: sample_ids must be a list of str, got {type(sample_ids).__name__}"
        )
    ids = list(sample_ids)
    if not set(map(type, ids)) <= {str}:
        raise TypeError(
            f"{where}: sample_ids must be strings, got {_name_some([s for s in ids if not isinstance(s, str)])}"
        )
    if len(ids) != n:
        raise ValueError(f"{where}: {len(ids)} sample_ids for a batch of {n} rows")
    if len(set(ids)) != n:
        seen: set[str] = set()
        dups = sorted({s for s in ids if s in seen or seen.add(s)})  # type: ignore[func-returns-value]
        raise ValueError(f"{where}: duplicate sample_ids {_name_some(dups)}")
    if tags is not None:
        if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Sequence):
            raise TypeError(f"{where}: tags must be a list of dicts, got {type(tags).__name__}")
        if len(tags) != n:
            raise ValueError(f"{where}: {len(tags)} tags for a batch of {n} rows")
        if not all(isinstance(t, Mapping) for t in tags):
            raise TypeError(f"{where}: each tag must be a dict of primitives")
    lengths = _lengths_tensor(where, INPUT_LENGTHS, batch[INPUT_LENGTHS], n)
    columns = to_wire_columns(batch, lengths)
    put = {
        "sample_ids": ids,
        "partition_id": partition_id,
        "fields": as_batch(columns, n),
        "tags": None if tags is None else [dict(t) for t in tags],
    }
    try:
        put_meta = _put(client, put, "upsert" if overwrite else "insert")
    except ValueError:
        # A retry of a first_write whose put landed (whole, or field by field on a backend that
        # is not atomic) before the caller saw an error finds its own rows: complete them.
        if overwrite or not _rows_hold_this_write(client, ids, partition_id, columns):
            raise
        put_meta = _put(client, put, "upsert")
    info = dict(extra_info or {})
    if pad_to_multiple > 1:
        info[PAD_TO_MULTIPLE] = pad_to_multiple
    return KVBatchMeta(
        partition_id=partition_id,
        task_name=task_name,
        sample_ids=ids,
        fields=list(columns),
        sequence_lengths=lengths.tolist(),
        extra_info=info,
        tags=put_meta.tags,
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal rows (NaN equal to itself), jagged or dense."""
    if a.is_nested != b.is_nested or a.dtype != b.dtype:
        return False
    if a.is_nested:
        if not torch.equal(_row_lengths(a).cpu(), _row_lengths(b).cpu()):
            return False
        a, b = a.values(), b.values()
    if a.shape != b.shape:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _rows_hold_this_write(
    client: Any, ids: list[str], partition_id: str, columns: Mapping[str, torch.Tensor]
) -> bool:
    """True when the rows ``ids`` already hold some of ``columns``, each exactly as given, and
    nothing that differs: the trace of an earlier attempt of this same write.

    Rows that also hold a training column this write does not carry (``input_ids``, say) were
    written by someone else, however equal the shared columns are: not a retry.
    """
    for name in sorted({*DP_TRAIN_FIELDS, *TOKEN_ALIGNED_FIELDS} - set(columns)):
        try:
            call_dp(client, "get_samples", sample_ids=ids, partition_id=partition_id,
                    select_fields=[name])
        except KeyError:
            continue
        return False
    matched = 0
    for name, value in columns.items():
        try:
            td = call_dp(
                client, "get_samples", sample_ids=ids, partition_id=partition_id, select_fields=[name]
            )
        except KeyError:
            continue  # this field did not land (for some row): the retry writes it
        if name not in td.keys() or not _same_values(td[name], value):  # noqa: SIM118
            return False
        matched += 1
    return matched > 0


def _stored_lengths(client: Any, meta: KVBatchMeta, claimed: torch.Tensor | None) -> torch.Tensor:
    """The partition's ``input_lengths`` for ``meta``'s rows; ``ValueError`` when ``claimed``
    (the meta's lengths) disagrees with them (naming the ids and both lengths)."""
    stored = call_dp(
        client,
        "get_samples",
        sample_ids=list(meta.sample_ids),
        partition_id=meta.partition_id,
        select_fields=[INPUT_LENGTHS],
    )[INPUT_LENGTHS]
    stored = _lengths_tensor("write_columns", f"stored {INPUT_LENGTHS}", stored, meta.size)
    if claimed is not None:
        differ = torch.nonzero(stored != claimed).flatten()
        if differ.numel():
            rows = differ[:5].tolist()
            raise ValueError(
                "write_columns: meta.sequence_lengths disagree with the stored "
                f"{INPUT_LENGTHS!r} for sample_ids {_name_some([meta.sample_ids[i] for i in rows])}: "
                f"meta says {claimed[differ[:5]].tolist()}, the store holds "
                f"{stored[differ[:5]].tolist()} ({differ.numel()} rows differ; a stale meta?)"
            )
    return stored


def write_columns(
    client: Any, meta: KVBatchMeta, fields: Mapping[str, Any] | TensorDictBase
) -> None:
    """Write columns under ``meta``'s keys; per-token columns are cut to the rows' lengths.

    So a padded write-back (``[N, pad_target]`` advantages, say) lands jagged, at the same row
    lengths as the first put, and the next padded read lines up with ``input_ids``. Rows must
    already exist (the put runs in ``mode="update"``), so a typo'd id never mints a row. A write
    of per-token columns is checked against the rows' stored ``input_lengths``: by the store
    inside the put when it says it does (``client.checks_token_alignment``, as
    ``LocalDataPlane`` and ``RayDataPlane`` do), else by one small dense read first. A meta
    without lengths takes the stored ones. Nothing is written unless every check passes. Raises:

    * ``TypeError``: ``meta`` not a ``KVBatchMeta``, ``fields`` not a mapping of tensors, a
      non-jagged nested tensor;
    * ``ValueError``: a negative or misaligned ``meta.sequence_lengths``, lengths that disagree
      with the stored ``input_lengths`` (naming ids and both lengths), a per-token column that
      would be truncated or whose jagged rows disagree, duplicate ids; and the store's schema
      errors;
    * ``KeyError``: an id not in the partition (from the store, naming it), or per-token
      columns written to rows that never had ``input_lengths``.
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"write_columns: meta must be a KVBatchMeta, got {type(meta).__name__}")
    _check_fields("write_columns", fields)
    if not len(fields.keys()):
        return
    claimed = (
        None
        if meta.sequence_lengths is None
        else _lengths_tensor(
            "write_columns", "meta.sequence_lengths", meta.sequence_lengths, meta.size
        )
    )
    per_token = [name for name in fields.keys() if name in TOKEN_ALIGNED_FIELDS]  # noqa: SIM118
    columns = to_wire_columns(fields, claimed) if claimed is not None else None
    # A store that checks jagged per-token rows against its own input_lengths inside the put
    # (atomic, no extra read) says so; otherwise, or when a per-token name arrives as a dense
    # per-row column (which that check does not cover), the stored lengths are read and compared.
    store_checks = getattr(client, "checks_token_alignment", False) and columns is not None
    if per_token and not (store_checks and all(columns[n].is_nested for n in per_token)):  # type: ignore[index]
        columns = to_wire_columns(fields, _stored_lengths(client, meta, claimed))
    elif columns is None:
        columns = to_wire_columns(fields, None)
    put = {"sample_ids": list(meta.sample_ids), "partition_id": meta.partition_id,
           "fields": as_batch(columns, meta.size)}
    _put(client, put, "update")


def as_batch(columns: Mapping[str, torch.Tensor], n: int) -> TensorDict:
    """A put's payload as the contract types it: a ``TensorDict`` of batch ``[n]``."""
    return TensorDict(dict(columns), batch_size=[n])


def _put(client: Any, put: dict[str, Any], mode: str) -> Any:
    """``put_samples`` with ``mode``; for a client without modes (the reference contract), the
    ids are checked against the partition's listing first ("insert": none may exist, "update":
    all must), then a plain put."""
    if accepts_put_mode(client):
        return call_dp(client, "put_samples", **put, mode=mode)
    if mode != "upsert":
        held = set(call_dp(client, "list_sample_ids", partition_id=put["partition_id"]))
        ids = put["sample_ids"]
        if mode == "insert" and held.intersection(ids):
            clash = [s for s in ids if s in held]
            raise ValueError(
                f"put_samples(mode='insert'): {len(clash)} sample_ids already exist in partition "
                f"{put['partition_id']!r}: {_name_some(clash)}"
            )
        if mode == "update" and not held.issuperset(ids):
            unknown = [s for s in ids if s not in held]
            raise KeyError(
                f"put_samples(mode='update'): {len(unknown)} sample_ids were never written to "
                f"partition {put['partition_id']!r}: {_name_some(unknown)}"
            )
    return call_dp(client, "put_samples", **put)


def _pad_target(where: str, extra_info: Mapping[str, Any]) -> int:
    value = extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0)
    return _int_arg(where, f"extra_info[{GLOBAL_FORWARD_PAD_SEQLEN!r}]", value, 0)


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not exposed here: no upper bound to check
        return 1 << 62


def _padded(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, make: Any, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """Run ``make(*args, **kwargs)`` to build a padded ``shape`` column, with clear errors for a size no
    machine can hold (``ValueError``) or this one cannot now (``MemoryError``)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    rule = (
        f"the pad target ({GLOBAL_FORWARD_PAD_SEQLEN} / pad_to_seqlen) is round_up(longest row, "
        "multiple); a target this large usually means corrupt sequence_lengths or extra_info"
    )
    if numel >= 1 << 63 or nbytes > _physical_memory_bytes():
        raise ValueError(
            f"materialize: padding field {name!r} to shape {list(shape)} needs {nbytes} bytes, "
            f"more than this machine's memory; {rule}"
        )
    try:
        return make(*args, **kwargs)
    except (RuntimeError, MemoryError) as exc:
        if "alloc" not in str(exc) and not isinstance(exc, MemoryError):
            raise
        raise MemoryError(
            f"materialize: padding field {name!r} to shape {list(shape)} needs {nbytes} bytes "
            f"and the allocation failed; {rule}"
        ) from exc


def materialize(
    td: TensorDictBase,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, Any] | None = None,
    pad_to_seqlen: int = 0,
) -> TensorDict:
    """Turn a wire read into trainer tensors.

    ``"jagged"`` returns nested columns untouched. ``"padded"`` pads each jagged column with its
    pad value (default 0), then widens per-token columns (jagged ones, and dense ones named in
    ``TOKEN_ALIGNED_FIELDS``) on dim 1 to ``pad_to_seqlen``. Dense non-token columns (image
    features, per-row scalars) are never widened, and nothing is ever truncated.

    ``ValueError`` for an unknown layout, a negative ``pad_to_seqlen`` or a padded column larger
    than this machine's memory; ``TypeError`` for a non-int ``pad_to_seqlen``; ``MemoryError``
    (naming the field and the pad target) when the padded column cannot be allocated now.
    """
    if layout not in ("padded", "jagged"):
        raise ValueError(f"materialize: layout must be 'padded' or 'jagged', got {layout!r}")
    pad_to_seqlen = _int_arg("materialize", "pad_to_seqlen", pad_to_seqlen, 0)
    pads = dict(pad_value_dict or {})
    out: dict[str, torch.Tensor] = {}
    for name, value in td.items():
        if layout == "jagged":
            out[name] = value
            continue
        pad = pads.get(name, 0)
        per_token = value.is_nested or name in TOKEN_ALIGNED_FIELDS
        if value.is_nested:
            n = value.size(0)
            longest = int(_row_lengths(value).max()) if n else 0
            size = (n, max(longest, pad_to_seqlen), *value.shape[2:])
            value = _padded(
                name, size, value.dtype, torch.nested.to_padded_tensor, value, pad, output_size=size
            )
        elif per_token and value.dim() >= 2 and value.shape[1] < pad_to_seqlen:
            widen = [0, 0] * (value.dim() - 2) + [0, pad_to_seqlen - value.shape[1]]
            size = (value.shape[0], pad_to_seqlen, *value.shape[2:])
            value = _padded(name, size, value.dtype, F.pad, value, widen, value=pad)
        out[name] = value
    return TensorDict(out, batch_size=td.batch_size)


def read_columns(
    client: Any,
    meta: KVBatchMeta,
    select_fields: Sequence[str],
    *,
    layout: Layout = "padded",
    pad_value_dict: Mapping[str, Any] | None = None,
) -> TensorDict:
    """Fetch ``select_fields`` for ``meta``'s rows and materialize them.

    Pads to ``meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]`` when present; it never mints one.
    Raises ``TypeError`` (``meta`` not a ``KVBatchMeta``, ``select_fields`` not a list of str,
    a non-int pad target), ``ValueError`` (a negative pad target, or one whose padded columns
    exceed this machine's memory; see :func:`materialize`), ``MemoryError`` (the padded
    allocation failed), and the store's ``KeyError`` for an unknown id or an unwritten field.
    """
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"read_columns: meta must be a KVBatchMeta, got {type(meta).__name__}")
    if isinstance(select_fields, (str, bytes)) or not isinstance(select_fields, Sequence):
        raise TypeError(
            f"read_columns: select_fields must be a list of field names, got "
            f"{type(select_fields).__name__} {select_fields!r}"
        )
    pad_to = _pad_target("read_columns", meta.extra_info)
    td = call_dp(
        client,
        "get_samples",
        sample_ids=list(meta.sample_ids),
        partition_id=meta.partition_id,
        select_fields=list(select_fields),
    )
    _check_whole_read("read_columns", td, meta.size, list(select_fields))
    return materialize(td, layout, pad_value_dict, pad_to)


def _check_whole_read(where: str, td: Any, n: int, names: list[str]) -> None:
    """``KeyError`` unless ``td`` holds every requested field with exactly ``n`` rows: a client
    that answers fewer rows than it was asked for must never pass as a whole read."""
    missing = [name for name in names if name not in td.keys()]  # noqa: SIM118
    short = {
        name: int(v.size(0)) for name in names if name not in missing
        for v in (td[name],) if int(v.size(0)) != n
    }
    if missing or short:
        raise KeyError(
            f"{where}: the store answered a short read for {n} sample_ids: "
            f"missing fields {missing}, fields with another row count {short}"
        )


def stamp_global_forward_pad_seqlen(meta: KVBatchMeta, *, sequence_length_round: int = 1) -> None:
    """Raise ``meta``'s pad target to cover its longest row (a ratchet: it never shrinks).

    ``target = round_up(max(sequence_lengths), max(pad_to_multiple, sequence_length_round))``.
    Mint it on the whole step meta before sharding: every shard inherits the same value.
    ``TypeError`` for a non-int ``sequence_length_round``, ``pad_to_multiple`` or existing pad
    target; ``ValueError`` for one below its minimum or a negative ``sequence_lengths`` entry.
    Nothing is stamped unless every check passes.
    """
    where = "stamp_global_forward_pad_seqlen"
    if not isinstance(meta, KVBatchMeta):
        raise TypeError(f"{where}: meta must be a KVBatchMeta, got {type(meta).__name__}")
    sequence_length_round = _int_arg(where, "sequence_length_round", sequence_length_round, 1)
    multiple = _int_arg(
        where, f"extra_info[{PAD_TO_MULTIPLE!r}]", meta.extra_info.get(PAD_TO_MULTIPLE, 1), 1
    )
    current = _pad_target(where, meta.extra_info)
    if not meta.sequence_lengths:
        return
    lengths = _lengths_tensor(where, "meta.sequence_lengths", meta.sequence_lengths, meta.size)
    target = round_up(int(lengths.max()), max(multiple, sequence_length_round))
    if target > current:
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
