"""One calling convention for the data-plane client, and the shim that keeps the old one working.

Every client method that names rows takes the partition first, then the rows, then the columns,
and by keyword only (a positional order is what a reader would have to guess)::

    client.put_samples(partition_id="rollouts", sample_ids=ids, fields=batch, tags=tags)
    client.get_samples(partition_id="rollouts", sample_ids=ids, select_fields=["input_ids"])
    client.get_tags(partition_id="rollouts", sample_ids=ids)
    client.clear_samples(partition_id="rollouts", sample_ids=ids)  # sample_ids=None: all of it

The methods without rows already read that way (``register_partition(partition_id, fields)``,
``list_sample_ids(partition_id)``, ``claim_meta(partition_id, ...)``).

For one release, a positional call in the old order (``put_samples(ids, "rollouts", batch)``:
``sample_ids`` first) still works: ``uniform_call`` maps it to keywords and emits a
``DeprecationWarning`` at the caller's line naming the keyword call. Every backend decorates its
row methods with it; wrappers that forward calls (``client.bind_keywords``, ``SplitClient``)
map through ``as_keywords``, and ``partition_of`` reads a call's partition either way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

# The row methods' parameters in the deprecated positional order (sample_ids first).
OLD_ORDER: dict[str, tuple[str, ...]] = {
    "put_samples": ("sample_ids", "partition_id", "fields", "tags"),
    "get_samples": ("sample_ids", "partition_id", "select_fields"),
    "get_tags": ("sample_ids", "partition_id"),
    "clear_samples": ("sample_ids", "partition_id"),
}

# The keyword call each row method takes now, as its deprecation warning spells it.
KEYWORD_CALL: dict[str, str] = {
    "put_samples": "put_samples(partition_id=..., sample_ids=..., fields=..., tags=...)",
    "get_samples": "get_samples(partition_id=..., sample_ids=..., select_fields=...)",
    "get_tags": "get_tags(partition_id=..., sample_ids=...)",
    "clear_samples": "clear_samples(partition_id=..., sample_ids=...)",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def as_keywords(
    method: str, args: tuple, kwargs: Mapping[str, Any], *, stacklevel: int = 2
) -> dict[str, Any]:
    """A row-method call's arguments as keywords; ``args`` are read in the old positional order.

    Positional arguments emit a ``DeprecationWarning`` (``stacklevel`` as ``warnings.warn``
    counts it from the function calling this one: 2 is that function's caller). Raises
    ``TypeError`` for more positions than the old order had, a name given twice, or a
    positional call in the new order (a partition id where ``sample_ids`` stood).
    """
    out = dict(kwargs)
    if not args:
        return out
    order = OLD_ORDER.get(method)
    if order is None:
        raise TypeError(f"{method}() is not a row method ({', '.join(OLD_ORDER)})")
    new_call = KEYWORD_CALL[method]
    if len(args) > len(order):
        raise TypeError(
            f"{method}() takes at most {len(order)} positional arguments in the deprecated "
            f"order ({', '.join(order)}), got {len(args)}; call {new_call}"
        )
    if isinstance(args[0], (str, bytes)):
        # Old-order sample_ids are a list (a bare string was always refused): this is a
        # partition id, written in the new order but by position.
        raise TypeError(f"{method}() takes its arguments by keyword: call {new_call}")
    for name, value in zip(order, args):
        if name in out:
            raise TypeError(f"{method}() got multiple values for argument {name!r}")
        out[name] = value
    warnings.warn(
        f"{method}(sample_ids, partition_id, ...) by position is deprecated and will be removed "
        f"in the next release: call {new_call} by keyword",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return out


def uniform_call(method: _F) -> _F:
    """Decorate a backend's row method (keyword-only, named in ``OLD_ORDER``) so a positional
    call in the old order still reaches it, with a ``DeprecationWarning`` at the caller.

    The wrapper keeps the method's name, docstring and keyword-only signature
    (``inspect.signature`` follows ``__wrapped__``), so ``accepts_put_mode`` still reads it.
    """
    name = method.__name__
    if name not in OLD_ORDER:
        raise TypeError(f"uniform_call: {name}() is not a row method ({', '.join(OLD_ORDER)})")

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs = as_keywords(name, args, kwargs, stacklevel=2)
        return method(self, **kwargs)

    return call  # type: ignore[return-value]


def partition_of(method: str, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """The partition a client call names: by keyword, else at its position (the old order's
    for a row method, the first for every other method that takes one)."""
    if "partition_id" in kwargs:
        return kwargs["partition_id"]
    position = OLD_ORDER[method].index("partition_id") if method in OLD_ORDER else 0
    if len(args) <= position:
        raise TypeError(f"{method}() needs partition_id=")
    return args[position]


__all__ = ["KEYWORD_CALL", "OLD_ORDER", "as_keywords", "partition_of", "uniform_call"]
