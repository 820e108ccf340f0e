"""Column I/O between trainer code and the data plane: first write, write-back, padded reads.

Per-token columns live jagged on the wire (one row of exactly ``input_lengths[i]`` elements), so
padding is paid only when a consumer materializes a read, and always to one pad target per step
(``extra_info[GLOBAL_FORWARD_PAD_SEQLEN]``), so every data-parallel rank sees the same dim 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane.client import call_dp
from tq_plugin.data_plane.jagged import (
    jaggedize,
    round_up,
    row_lengths,
)
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.padding import int_arg, materialize
from tq_plugin.data_plane.puts import as_batch, name_some, put_with_mode, rows_hold_this_write
from tq_plugin.data_plane.schema import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    INPUT_LENGTHS,
    PAD_TO_MULTIPLE,
    SAMPLE_MASK,
    TOKEN_ALIGNED_FIELDS,
    Layout,
)


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
                got = row_lengths(value).cpu()
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
    pad_to_multiple = int_arg(where, "pad_to_multiple", pad_to_multiple, 1)
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
            f"{where}: sample_ids must be strings, got {name_some([s for s in ids if not isinstance(s, str)])}"
        )
    if len(ids) != n:
        raise ValueError(f"{where}: {len(ids)} sample_ids for a batch of {n} rows")
    if len(set(ids)) != n:
        seen: set[str] = set()
        dups = sorted({s for s in ids if s in seen or seen.add(s)})  # type: ignore[func-returns-value]
        raise ValueError(f"{where}: duplicate sample_ids {name_some(dups)}")
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
        put_meta = put_with_mode(client, put, "upsert" if overwrite else "insert")
    except ValueError:
        # A retry of a first_write whose put landed (whole, or field by field on a backend that
        # is not atomic) before the caller saw an error finds its own rows: complete them.
        if overwrite or not rows_hold_this_write(client, ids, partition_id, columns):
            raise
        put_meta = put_with_mode(client, put, "upsert")
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
                f"{INPUT_LENGTHS!r} for sample_ids {name_some([meta.sample_ids[i] for i in rows])}: "
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
    per_token = [fields[n] for n in fields.keys() if n in TOKEN_ALIGNED_FIELDS]  # noqa: SIM118
    # A store that checks jagged per-token rows against its own input_lengths inside the put
    # (atomic, no extra read) says so. Otherwise, without the meta's lengths, or when a per-token
    # name arrives as a dense per-row column (which that check does not cover), the stored
    # lengths are read and compared first. Per-token columns travel jagged when they come
    # nested or padded (dim >= 2), so this is known before any column is built.
    store_checks = claimed is not None and getattr(client, "checks_token_alignment", False)
    jagged_on_wire = all(isinstance(v, torch.Tensor) and (v.is_nested or v.dim() >= 2)
                         for v in per_token)
    lengths = claimed
    if per_token and not (store_checks and jagged_on_wire):
        lengths = _stored_lengths(client, meta, claimed)
    columns = to_wire_columns(fields, lengths)
    put = {"sample_ids": list(meta.sample_ids), "partition_id": meta.partition_id,
           "fields": as_batch(columns, meta.size)}
    put_with_mode(client, put, "update")


def _pad_target(where: str, extra_info: Mapping[str, Any]) -> int:
    value = extra_info.get(GLOBAL_FORWARD_PAD_SEQLEN, 0)
    return int_arg(where, f"extra_info[{GLOBAL_FORWARD_PAD_SEQLEN!r}]", value, 0)


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
    sequence_length_round = int_arg(where, "sequence_length_round", sequence_length_round, 1)
    multiple = int_arg(
        where, f"extra_info[{PAD_TO_MULTIPLE!r}]", meta.extra_info.get(PAD_TO_MULTIPLE, 1), 1
    )
    current = _pad_target(where, meta.extra_info)
    if not meta.sequence_lengths:
        return
    lengths = _lengths_tensor(where, "meta.sequence_lengths", meta.sequence_lengths, meta.size)
    target = round_up(int(lengths.max()), max(multiple, sequence_length_round))
    if target > current:
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = target
