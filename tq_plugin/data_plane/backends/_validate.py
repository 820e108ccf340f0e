"""Argument checks for the embedded backend: everything a put or a read is validated against
before the store changes.

Every check raises one documented type naming the argument or field and the rule:
``TypeError`` for a wrong kind of value (a ``str`` where a list of ids belongs, a sparse tensor,
a dtype change), ``ValueError`` for a wrong value (duplicate ids, a row count, broken jagged
offsets), ``KeyError`` for something that is not there. Nothing here mutates the store.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase
from torch.nested._internal.nested_tensor import NestedTensor

from tq_plugin.data_plane.backends._columns import ColumnSpec, dtype_support
from tq_plugin.data_plane.client import FieldsLike
from tq_plugin.data_plane.schema import INPUT_LENGTHS, TOKEN_ALIGNED_FIELDS

_SHOW = 5  # how many offending items an error message names
_PRIMITIVES = frozenset({str, int, float, bool, type(None)})


def name_some(items: Sequence[Any]) -> str:
    shown = ", ".join(repr(x) for x in list(items)[:_SHOW])
    more = f" (+{len(items) - _SHOW} more)" if len(items) > _SHOW else ""
    return f"[{shown}]{more}"


def duplicates(ids: Sequence[str]) -> list[str]:
    if len(set(ids)) == len(ids):
        return []
    seen: set[str] = set()
    return list(dict.fromkeys(s for s in ids if s in seen or seen.add(s)))


def str_list(values: Any, where: str, what: str, *, unique: bool = True) -> list[str]:
    """``values`` as a list of strings; a bare ``str`` is refused, never split into characters."""
    if isinstance(values, (str, bytes)):
        raise TypeError(
            f"{where}: {what} must be a list of strings, not a single {type(values).__name__} "
            f"{values!r:.60} (wrap one name in a list)"
        )
    try:
        out = list(values)
    except TypeError:
        raise TypeError(
            f"{where}: {what} must be a list of strings, got {type(values).__name__}"
        ) from None
    if not set(map(type, out)) <= {str}:
        bad = [x for x in out if not isinstance(x, str)]
        if bad:
            raise TypeError(f"{where}: {what} must be strings, got {name_some(bad)}")
        out = [str(x) for x in out]  # str subclasses (numpy.str_) become plain str
    if unique:
        dups = duplicates(out)
        if dups:
            raise ValueError(f"{where}: duplicate {what}: {name_some(dups)}")
    return out


def optional_count(value: Any, where: str, what: str) -> int | None:
    """``None`` or a positive int (``bool`` and numeric strings are refused)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {what} must be a positive int or None, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{where}: {what} must be > 0, got {value}")
    return int(value)


def _copy_value(v: Any) -> Any:
    return v if type(v) in _PRIMITIVES else copy.deepcopy(v)


def copy_tag(tag: Mapping[str, Any]) -> dict[str, Any]:
    """A copy the caller cannot change from outside (nested values deep-copied)."""
    return {k: _copy_value(v) for k, v in tag.items()}


def checked_tags(tags: Any, n: int, where: str) -> list[dict[str, Any]] | None:
    """One mapping with string keys per row, copied so a caller's later mutation changes nothing."""
    if tags is None:
        return None
    if isinstance(tags, (str, bytes, Mapping)) or not hasattr(tags, "__iter__"):
        raise TypeError(f"{where}: tags must be a list with one mapping per sample, got {type(tags).__name__}")
    rows = list(tags)
    if len(rows) != n:
        raise ValueError(f"{where}: got {len(rows)} tags for {n} sample_ids")
    out = []
    for i, t in enumerate(rows):
        if not isinstance(t, Mapping):
            raise TypeError(f"{where}: tags[{i}] must be a mapping, got {type(t).__name__}")
        if not set(map(type, t)) <= {str}:
            raise TypeError(f"{where}: tags[{i}] keys must be strings, got {name_some([k for k in t if not isinstance(k, str)])}")
        out.append(copy_tag(t))
    return out


class Prepared(NamedTuple):
    """One field of a put, validated and normalized, ready to write."""

    name: str
    spec: ColumnSpec
    block: torch.Tensor  # dense: [N, *shape]; jagged: values [total, *shape]
    lengths: np.ndarray | None  # jagged only: [N]
    promote: bool  # a live dense column must become jagged first (rows of another length)


def field_items(fields: FieldsLike | None, n: int) -> list[tuple[str, torch.Tensor]]:
    """Flatten a put's payload to (name, tensor) pairs, rejecting what a column cannot hold."""
    if fields is None:
        return []
    if isinstance(fields, TensorDictBase):
        if tuple(fields.batch_size) != (n,):
            raise ValueError(
                f"put_samples: fields.batch_size is {tuple(fields.batch_size)}, expected ({n},)"
            )
        pairs = list(fields.items())
    elif isinstance(fields, Mapping):
        pairs = list(fields.items())
    else:
        raise TypeError(
            f"put_samples: fields must be a TensorDict or a mapping of tensors, got {type(fields).__name__}"
        )
    tensor = torch.Tensor
    for name, value in pairs:
        if type(name) is not str and not isinstance(name, str):
            raise TypeError(f"put_samples: field names must be strings, got {name!r}")
        if type(value) is not tensor and not isinstance(value, tensor):
            kind = type(value).__name__
            raise TypeError(
                f"put_samples: field {name!r} is a non-tensor leaf ({kind}); only tensors "
                "(dense or torch.jagged nested) are stored. Put primitives in tags."
            )
    return pairs


def lengths_from(items: list[tuple[str, torch.Tensor]]) -> list[int] | None:
    value = next((v for name, v in items if name == INPUT_LENGTHS), None)
    if value is not None and not value.is_nested and value.dim() == 1:
        return [int(x) for x in value.tolist()]
    return None


def check_storable(name: str, value: torch.Tensor) -> None:
    """Refuse what no column can hold (sparse, quantized, meta, uncopyable dtypes), naming it."""
    if value.layout is not torch.strided:
        raise TypeError(
            f"put_samples: field {name!r} has layout {value.layout}; only dense (strided) tensors "
            "and torch.jagged nested tensors are stored (call .to_dense() first)"
        )
    if value.is_quantized:
        raise TypeError(
            f"put_samples: field {name!r} is a quantized tensor; store .dequantize() or its int_repr()"
        )
    if value.is_meta:
        raise ValueError(f"put_samples: field {name!r} is on the meta device and holds no data")
    if not dtype_support(value.dtype)[0]:
        raise TypeError(
            f"put_samples: field {name!r} has dtype {value.dtype}, which torch cannot copy "
            "element-wise on this device; pack it into uint8 first"
        )


def raise_mismatch(name: str, held: ColumnSpec, given: ColumnSpec) -> None:
    if given.dtype != held.dtype:
        what, rule = "dtype", "a field keeps one dtype while it has live rows (cast it, or clear the rows)"
    else:
        what, rule = "shape", (
            "only the first per-row dim may differ between rows; the rank and the trailing dims "
            "are fixed while the field has live rows"
        )
    raise TypeError(
        f"put_samples: field {name!r} {what} mismatch: live rows hold {held.describe()}, "
        f"this put has {given.describe()}; {rule}"
    )


def _promotable(held: ColumnSpec, given: ColumnSpec) -> bool:
    """Dense rows ``[L, *t]`` that another row length joins: losslessly jagged over ``t``."""
    return (
        not held.jagged
        and held.dtype == given.dtype
        and len(held.shape) >= 1
        and held.shape[1:] == given.shape[(0 if given.jagged else 1) :]
        and (given.jagged or len(given.shape) == len(held.shape))
    )


def prepare(part: Any, name: str, value: torch.Tensor, n: int) -> Prepared:
    """Validate one field of a put against the partition's schema and normalize it.

    Runs once per field of every put (24 fields for a staged call), so it reads each tensor
    attribute once and builds nothing it does not return.
    """
    if part.declared and name not in part.declared:
        raise ValueError(
            f"put_samples: field {name!r} is not declared for partition "
            f"{part.partition_id!r}; declared fields: {sorted(part.declared)}"
        )
    col = part.columns.get(name)
    live = col if col is not None and col.live_rows > 0 else None
    # isinstance first: ``is_nested`` on a jagged tensor dispatches through Python (~10 us).
    if isinstance(value, NestedTensor) or value.is_nested:
        return _prepare_nested(name, value, n, live)
    check_storable(name, value)
    shape = value.shape
    if not shape:
        raise ValueError(f"put_samples: field {name!r} is 0-d; every field needs a row dim")
    if shape[0] != n:
        raise ValueError(f"put_samples: field {name!r} has {shape[0]} rows for {n} sample_ids")
    if value.requires_grad:
        value = value.detach()
    if not value.is_cpu:
        value = value.cpu()
    jagged = live.spec.jagged if live is not None else name in part.jagged
    if jagged:
        if len(shape) < 2:
            raise ValueError(
                f"put_samples: field {name!r} is jagged; a dense put needs shape "
                f"[N, L, ...], got {tuple(shape)}"
            )
        spec = ColumnSpec(True, value.dtype, tuple(shape[2:]))
        if live is not None and spec != live.spec:
            raise_mismatch(name, live.spec, spec)
        return Prepared(name, spec, value[0] if n == 1 else value.reshape(-1, *shape[2:]),
                        np.full(n, shape[1], dtype=np.int64), False)
    spec = ColumnSpec(False, value.dtype, tuple(shape[1:]))
    if live is None or spec == live.spec:
        return Prepared(name, spec, value, None, False)
    if not _promotable(live.spec, spec):
        raise_mismatch(name, live.spec, spec)
    # Rows of another length join a dense column: it becomes jagged, losslessly.
    return Prepared(name, ColumnSpec(True, value.dtype, tuple(shape[2:])),
                    value.reshape(-1, *shape[2:]), np.full(n, shape[1], dtype=np.int64), True)


def _prepare_nested(name: str, value: torch.Tensor, n: int, live: Any) -> Prepared:
    if not isinstance(value, NestedTensor):
        raise TypeError(
            f"put_samples: field {name!r} must be a torch.jagged nested tensor "
            "(build it with torch.nested.nested_tensor_from_jagged), not a strided one"
        )
    # A jagged tensor's own methods are slow (each goes through __torch_function__), so
    # work on its values/offsets buffers directly.
    offsets = value._offsets
    rows = offsets.shape[0] - 1
    if rows != n:
        raise ValueError(f"put_samples: field {name!r} has {rows} rows for {n} sample_ids")
    if value._ragged_idx != 1:
        raise TypeError(f"put_samples: field {name!r} must be ragged on dim 1")
    values = value._values
    check_storable(name, values)
    if offsets.dtype.is_floating_point or offsets.dtype.is_complex:
        raise TypeError(f"put_samples: field {name!r} has {offsets.dtype} offsets; they must be integers")
    o = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    total = values.shape[0]
    if value._lengths is None:
        lengths = np.diff(o)
        ok = rows == 0 or (o[0] >= 0 and o[-1] <= total and bool((lengths >= 0).all()))
        span = (int(o[0]), int(o[-1])) if rows else (0, 0)
    else:  # a narrowed view: row i is values[o[i] : o[i] + lengths[i]]
        lengths = value._lengths.detach().cpu().numpy().astype(np.int64, copy=False)
        ends = o[:-1] + lengths
        ok = rows == 0 or bool((lengths >= 0).all() and (o[:-1] >= 0).all() and (ends <= total).all())
        span = None
    if not ok:
        raise ValueError(
            f"put_samples: field {name!r} has invalid jagged offsets {name_some(o.tolist())} over "
            f"{total} values: offsets must start >= 0, never decrease, and stay within the values "
            "(row lengths must be >= 0)"
        )
    if span is None:
        values = value.contiguous()._values
    elif span != (0, total):
        values = values[span[0] : span[1]]
    block = values.detach()
    if not block.is_cpu:
        block = block.cpu()
    spec = ColumnSpec(True, block.dtype, tuple(block.shape[1:]))
    promote = False
    if live is not None and spec != live.spec:
        if not _promotable(live.spec, spec):
            if not live.spec.jagged and live.spec.dtype == spec.dtype:
                raise TypeError(
                    f"put_samples: field {name!r} is stored dense ({live.spec.describe()}); a "
                    "jagged put joins it only when each dense row is [L, *trailing] with the "
                    f"same trailing dims, got element shape {spec.shape}"
                )
            raise_mismatch(name, live.spec, spec)
        promote = True
    return Prepared(name, spec, block, lengths, promote)


def check_token_alignment(
    part: Any, ids: list[str], found: list[int | None], prepared: list[Prepared]
) -> None:
    """Jagged per-token columns must have each row's ``input_lengths`` elements.

    The lengths come from the put itself when it carries ``input_lengths``, else from the
    rows already stored, so a write-back can never drift out of line with ``input_ids``.
    """
    aligned = [p for p in prepared if p.spec.jagged and p.name in TOKEN_ALIGNED_FIELDS]
    if not aligned:
        return
    own = next((p for p in prepared if p.name == INPUT_LENGTHS), None)
    rows = np.arange(len(ids))
    if own is not None and not own.spec.jagged and own.spec.shape == ():
        expected = own.block.to(torch.int64).numpy()
    else:
        col = part.columns.get(INPUT_LENGTHS)
        if col is None or col.spec.jagged or col.spec.shape != () or None in found:
            if col is None or col.spec.jagged or col.spec.shape != ():
                return
            rows = np.array([i for i, x in enumerate(found) if x is not None], dtype=np.int64)
        slots = np.array([found[i] for i in rows.tolist()], dtype=np.int64)
        held = col.has(slots)
        rows, slots = rows[held], slots[held]
        if not rows.shape[0]:
            return
        expected = col.read(slots).to(torch.int64).numpy()
    for p in aligned:
        got = p.lengths[rows]  # type: ignore[index]
        bad = np.flatnonzero(got != expected)
        if bad.shape[0]:
            shown = [(ids[int(rows[i])], int(got[i]), int(expected[i])) for i in bad[:5].tolist()]
            raise ValueError(
                f"put_samples: field {p.name!r} is per-token, so each row must have "
                f"{INPUT_LENGTHS!r} elements; {bad.shape[0]} rows differ "
                f"(id, got, {INPUT_LENGTHS}): {shown}"
            )
