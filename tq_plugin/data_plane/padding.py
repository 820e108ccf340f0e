"""Padded reads: turning a wire read (jagged per-token columns) into trainer tensors padded to
the step's pad target, with clear errors for a target no machine can hold."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase

from tq_plugin.data_plane.jagged import row_lengths
from tq_plugin.data_plane.schema import GLOBAL_FORWARD_PAD_SEQLEN, TOKEN_ALIGNED_FIELDS, Layout


def int_arg(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``: ``TypeError`` when not an int, ``ValueError`` below."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value



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
    pad_to_seqlen = int_arg("materialize", "pad_to_seqlen", pad_to_seqlen, 0)
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
            longest = int(row_lengths(value).max()) if n else 0
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
