"""Planner arguments: NeMo RL's ``sequence_packing_args`` / ``dynamic_batching_args`` dicts and
row lengths, checked and normalized before any planning (``TypeError`` for a wrong type,
``ValueError`` for an out-of-range value; each message names the argument)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tq_plugin.config.schema import MICROBATCH_ORDERS, PACKING_ALGORITHMS

# "first_fit_decreasing": plain FFD. "modified_first_fit_decreasing": Johnson and Garey's MFFD
# (size classes; large rows first get medium rows and pairs of small rows, then FFD), the
# algorithm NeMo RL's exemplar configs name.
# Defined once, in the torch-free config schema (the layer below this one).
SEQUENCE_PACKING_ALGORITHMS = PACKING_ALGORITHMS

_SEQPACK_KEYS = frozenset(
    {
        "algorithm",
        "input_key",
        "input_lengths_key",
        "sequence_length_pad_multiple",
        "max_tokens_per_microbatch",
        "microbatch_order",
    }
)
_DYNBATCH_KEYS = frozenset(
    {"input_key", "input_lengths_key", "sequence_length_round", "max_tokens_per_microbatch"}
)


# ---------------------------------------------------------------------------- validation
def as_lengths(
    lengths: Sequence[int] | torch.Tensor, *, name: str = "sequence_lengths"
) -> torch.Tensor:
    """``lengths`` as a 1-D int64 CPU tensor.

    ``TypeError`` when the entries are not integers (floats, bools, strings, nested tensors);
    ``ValueError`` for a shape other than 1-D, an int beyond int64, or a negative length.
    """
    if isinstance(lengths, torch.Tensor) and lengths.is_nested:
        raise TypeError(f"{name} must be a dense 1-D integer tensor, got a nested tensor")
    if isinstance(lengths, (list, tuple)):
        kinds = set(map(type, lengths))
        if not kinds <= {int} and not all(
            issubclass(k, numbers.Integral) and k is not bool for k in kinds
        ):
            bad = sorted(
                k.__name__ for k in kinds if k is bool or not issubclass(k, numbers.Integral)
            )
            raise TypeError(f"{name} must hold ints, got {bad}")
    elif isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(lengths).__name__}")
    try:
        t = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError) as exc:  # ints beyond int64, odd array types
        raise ValueError(f"{name} must be a sequence of non-negative int64 values: {exc}") from None
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{name} must hold ints, got dtype {t.dtype}")
    t = t.to(device="cpu", dtype=torch.int64)
    if t.numel() and int(t.min()) < 0:
        bad = int(torch.nonzero(t < 0)[0, 0])
        raise ValueError(f"{name} must be non-negative: row {bad} has length {int(t[bad])}")
    return t


def _positive_int(args: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in args:
        if default is None:
            raise ValueError(f"{where}[{key!r}] is required")
        return default
    value = args[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where}[{key!r}] must be a positive int, got {type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"{where}[{key!r}] must be a positive int, got {value!r}")
    return int(value)


def _check_keys(args: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(args, Mapping):
        raise TypeError(f"{where} must be a dict, got {type(args).__name__}")
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def validate_sequence_packing_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of ``sequence_packing_args`` with defaults filled in.

    ``max_tokens_per_microbatch`` is required (a positive int); ``sequence_length_pad_multiple``
    defaults to 1, ``algorithm`` to ``"first_fit_decreasing"``, ``microbatch_order`` to
    ``"packer"``. Unknown keys are an error (they are usually typos). ``TypeError`` for a
    non-dict or a non-int count; ``ValueError`` for a missing, unknown or out-of-range value.
    """
    where = "sequence_packing_args"
    _check_keys(args, _SEQPACK_KEYS, where)
    out = dict(args)
    out["max_tokens_per_microbatch"] = _positive_int(args, "max_tokens_per_microbatch", where)
    out["sequence_length_pad_multiple"] = _positive_int(
        args, "sequence_length_pad_multiple", where, default=1
    )
    algorithm = args.get("algorithm", "first_fit_decreasing")
    if algorithm not in SEQUENCE_PACKING_ALGORITHMS:
        raise ValueError(
            f"{where}['algorithm'] = {algorithm!r} is not supported; "
            f"use one of {list(SEQUENCE_PACKING_ALGORITHMS)}"
        )
    out["algorithm"] = algorithm
    order = args.get("microbatch_order", "packer")
    if order not in MICROBATCH_ORDERS:
        raise ValueError(
            f"{where}['microbatch_order'] = {order!r}; use one of {list(MICROBATCH_ORDERS)}"
        )
    out["microbatch_order"] = order
    return out


def validate_dynamic_batching_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Checked copy of ``dynamic_batching_args``: ``max_tokens_per_microbatch`` required (> 0),
    ``sequence_length_round`` defaults to 1. Unknown keys are an error."""
    where = "dynamic_batching_args"
    _check_keys(args, _DYNBATCH_KEYS, where)
    out = dict(args)
    out["max_tokens_per_microbatch"] = _positive_int(args, "max_tokens_per_microbatch", where)
    out["sequence_length_round"] = _positive_int(args, "sequence_length_round", where, default=1)
    return out
