"""`KVBatchMeta`: the metadata receipt that travels instead of tensors.

A meta names rows (``sample_ids``) in one partition and, optionally, the fields a put wrote or a
consumer will read, each row's valid token length, a batch-level ``extra_info`` bag (pad target,
microbatch plan, ...) and per-row primitive ``tags``. It holds no tensors, so it pickles in
microseconds and can cross process boundaries freely. Every method except ``stamp_tags`` is pure
and returns a new meta.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# extra_info keys holding one entry per row: they must follow the rows through subset/concat.
PER_ROW_EXTRA_INFO_KEYS = ("packed_attention_segment_lengths",)


def _as_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TypeError(f"KVBatchMeta.{name} must be a list, got {type(value).__name__}")
    return value if type(value) is list else list(value)


def _str_list(name: str, value: Any) -> list[str]:
    out = _as_list(name, value)
    if not set(map(type, out)) <= {str}:
        bad = [x for x in out if not isinstance(x, str)][:3]
        raise TypeError(f"KVBatchMeta.{name} must hold strings, got {bad!r}")
    return out


def _indices(where: str, indices: Iterable[int], n: int) -> list[int]:
    """``indices`` as ints in ``[-n, n)``: ``TypeError`` for a non-integer, ``IndexError`` beyond."""
    try:
        idx = [operator.index(i) for i in indices]
    except TypeError:
        raise TypeError(f"KVBatchMeta.{where}: indices must be ints") from None
    for i in idx:
        if not -n <= i < n:
            raise IndexError(f"KVBatchMeta.{where}: index {i} out of range for size {n}")
    return idx


@dataclass
class KVBatchMeta:
    """Receipt for rows of one partition: keys, lengths, batch-level info and per-row tags.

    ``sample_ids`` uniqueness is not enforced here (a meta is a view); the data plane rejects
    duplicate ids where they would be ambiguous. ``tags`` must align 1:1 with ``sample_ids``.
    """

    partition_id: str
    task_name: str | None
    sample_ids: list[str]
    fields: list[str] | None = None
    sequence_lengths: list[int] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    tags: list[dict[str, Any]] | None = None

    @classmethod
    def trusted(
        cls,
        partition_id: str,
        task_name: str | None,
        sample_ids: list[str],
        fields: list[str] | None = None,
        sequence_lengths: list[int] | None = None,
        extra_info: dict[str, Any] | None = None,
        tags: list[dict[str, Any]] | None = None,
    ) -> KVBatchMeta:
        """A meta from parts the caller has already checked (a store answering a put), built
        without the constructor's checks: a one-row staging put pays ~10 us for them."""
        meta = object.__new__(cls)
        meta.__dict__.update(
            partition_id=partition_id, task_name=task_name, sample_ids=sample_ids, fields=fields,
            sequence_lengths=sequence_lengths,
            extra_info={} if extra_info is None else extra_info, tags=tags,
        )
        return meta

    def __post_init__(self) -> None:
        """Check types and alignment; ``TypeError`` for a wrong type, ``ValueError`` for misalignment.

        Value ranges (a negative length, say) are checked where a length is used (sharding,
        column I/O), so a meta built from whatever a store holds never fails after a write.
        """
        if not isinstance(self.partition_id, str):
            raise TypeError(
                f"KVBatchMeta.partition_id must be a str, got {type(self.partition_id).__name__}"
            )
        if self.task_name is not None and not isinstance(self.task_name, str):
            raise TypeError(
                f"KVBatchMeta.task_name must be a str or None, got {type(self.task_name).__name__}"
            )
        self.sample_ids = _str_list("sample_ids", self.sample_ids)
        if self.fields is not None:
            self.fields = _str_list("fields", self.fields)
        if not isinstance(self.extra_info, Mapping):
            raise TypeError(
                f"KVBatchMeta.extra_info must be a dict, got {type(self.extra_info).__name__}"
            )
        if self.sequence_lengths is not None:
            self.sequence_lengths = _as_list("sequence_lengths", self.sequence_lengths)
            kinds = set(map(type, self.sequence_lengths))
            if not kinds <= {int}:
                raise TypeError(
                    "KVBatchMeta.sequence_lengths must hold Python ints (use tensor.tolist()), "
                    f"got {sorted(k.__name__ for k in kinds - {int})}"
                )
            if len(self.sequence_lengths) != len(self.sample_ids):
                raise ValueError(
                    f"KVBatchMeta.sequence_lengths must align 1:1 with sample_ids: got "
                    f"{len(self.sequence_lengths)} lengths for {len(self.sample_ids)} sample_ids"
                )
        if self.tags is not None:
            self.tags = _as_list("tags", self.tags)
            if not all(isinstance(t, Mapping) for t in self.tags):
                raise TypeError("KVBatchMeta.tags must be a list of dicts (one per row)")
            if len(self.tags) != len(self.sample_ids):
                raise ValueError(
                    f"KVBatchMeta.tags must align 1:1 with sample_ids: "
                    f"got {len(self.tags)} tags for {len(self.sample_ids)} sample_ids"
                )

    @property
    def size(self) -> int:
        return len(self.sample_ids)

    def __len__(self) -> int:
        return len(self.sample_ids)

    # ------------------------------------------------------------------ row selection
    def subset(self, indices: Iterable[int]) -> KVBatchMeta:
        """Rows at ``indices``, in that order (duplicates allowed); lengths and tags follow.

        ``TypeError`` for a non-integer index, ``IndexError`` for one out of range, ``ValueError``
        when a per-row ``extra_info`` entry does not have one item per row.
        """
        n = self.size
        idx = _indices("subset", indices, n)
        extra = dict(self.extra_info)
        for key in PER_ROW_EXTRA_INFO_KEYS:
            if key in extra:
                rows = extra[key]
                if len(rows) != n:
                    raise ValueError(
                        f"KVBatchMeta.extra_info[{key!r}] has {len(rows)} rows, expected {n}"
                    )
                extra[key] = [rows[i] for i in idx]
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[self.sample_ids[i] for i in idx],
            fields=None if self.fields is None else list(self.fields),
            sequence_lengths=(
                None if self.sequence_lengths is None else [self.sequence_lengths[i] for i in idx]
            ),
            extra_info=extra,
            tags=None if self.tags is None else [dict(self.tags[i]) for i in idx],
        )

    def slice(self, start: int, stop: int) -> KVBatchMeta:
        """Contiguous rows ``[start, stop)``; out-of-range bounds raise ``IndexError``.

        ``TypeError`` when a bound is not an int.
        """
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in (start, stop)):
            raise TypeError(
                f"KVBatchMeta.slice: start and stop must be ints, got {start!r}, {stop!r}"
            )
        if not 0 <= start <= stop <= self.size:
            raise IndexError(
                f"KVBatchMeta.slice({start}, {stop}) out of range for size {self.size}"
            )
        return self.subset(range(start, stop))

    def drop(self, indices: Iterable[int]) -> KVBatchMeta | None:
        """The complement of ``subset``: every row not in ``indices``; ``None`` when none is left.

        ``TypeError`` for a non-integer index, ``IndexError`` for one out of range (never a
        silent wrap-around onto another row).
        """
        dropped = {i % self.size for i in _indices("drop", indices, self.size)}
        keep = [i for i in range(self.size) if i not in dropped]
        if not keep:
            return None
        return self.subset(keep)

    def concat(self, *others: KVBatchMeta) -> KVBatchMeta:
        """Rows of ``self`` then each of ``others``; all must share ``partition_id``.

        Lengths and tags survive only when every input has them; ``fields`` is the union in
        first-seen order; ``extra_info`` comes from ``self``. ``TypeError`` when an input is not
        a ``KVBatchMeta``; ``ValueError`` for a partition mismatch or a per-row ``extra_info``
        entry present on some inputs only.
        """
        metas = (self, *others)
        for m in others:
            if not isinstance(m, KVBatchMeta):
                raise TypeError(f"KVBatchMeta.concat: expected KVBatchMeta, got {type(m).__name__}")
            if m.partition_id != self.partition_id:
                raise ValueError(
                    "KVBatchMeta.concat: partition_ids must match "
                    f"({self.partition_id!r} != {m.partition_id!r})"
                )
        fields: list[str] = []
        for m in metas:
            for name in m.fields or ():
                if name not in fields:
                    fields.append(name)
        seqlens = (
            [x for m in metas for x in m.sequence_lengths]  # type: ignore[union-attr]
            if all(m.sequence_lengths is not None for m in metas)
            else None
        )
        tags = (
            [dict(t) for m in metas for t in m.tags]  # type: ignore[union-attr]
            if all(m.tags is not None for m in metas)
            else None
        )
        extra = dict(self.extra_info)
        for key in PER_ROW_EXTRA_INFO_KEYS:
            if any(key in m.extra_info for m in metas):
                if not all(key in m.extra_info for m in metas):
                    raise ValueError(
                        f"KVBatchMeta.concat: extra_info[{key!r}] is present on some inputs only"
                    )
                extra[key] = [r for m in metas for r in m.extra_info[key]]
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=[s for m in metas for s in m.sample_ids],
            fields=fields or None,
            sequence_lengths=seqlens,
            extra_info=extra,
            tags=tags,
        )

    # ------------------------------------------------------------------ fields and tags
    def with_fields(self, names: Iterable[str]) -> KVBatchMeta:
        """A new meta whose ``fields`` adds ``names`` (order-preserving, de-duplicated)."""
        fields = list(self.fields or ())
        for name in names:
            if name not in fields:
                fields.append(name)
        return KVBatchMeta(
            partition_id=self.partition_id,
            task_name=self.task_name,
            sample_ids=list(self.sample_ids),
            fields=fields,
            sequence_lengths=None if self.sequence_lengths is None else list(self.sequence_lengths),
            extra_info=copy.copy(self.extra_info),
            tags=None if self.tags is None else [dict(t) for t in self.tags],
        )

    def stamp_tags(self, scalars: Mapping[str, Sequence[Any]]) -> None:
        """Set ``tags[i][name] = values[i]`` for each name, in place.

        All lengths are checked before any tag is written, so a bad call stamps nothing:
        ``TypeError`` when ``scalars`` is not a mapping of names to sequences, ``ValueError`` when
        a sequence does not have one value per row.
        """
        if not isinstance(scalars, Mapping):
            raise TypeError(f"stamp_tags: scalars must be a dict, got {type(scalars).__name__}")
        for name, values in scalars.items():
            if not isinstance(name, str) or not hasattr(values, "__len__"):
                raise TypeError(f"stamp_tags: {name!r} must map a str to a sequence of values")
            if len(values) != self.size:
                raise ValueError(
                    f"stamp_tags: {name!r} has {len(values)} values, expected {self.size}"
                )
        if self.tags is None:
            self.tags = [{} for _ in range(self.size)]
        for name, values in scalars.items():
            for row, value in zip(self.tags, values):
                row[name] = value
