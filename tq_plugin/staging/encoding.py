"""Column encodings for the staging digest: exact-type checks and big-endian bytes of token-id
and float columns (Python lists through one ``marshal`` pass, tensors and arrays through numpy),
the text and digest fields, and the mask/carry rules. ``digest`` hashes what these produce."""

from __future__ import annotations

import marshal
import math
import struct
from itertools import compress
from operator import not_
from typing import Any

import numpy as np
import torch

_U64_MAX = 2**64 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_F32 = struct.Struct(">f")
_FRAME = struct.Struct(">QQ")
# The smallest magnitude that rounds (nearest-even) to infinity as float32.
_F32_OVERFLOW = 2.0**128 - 2.0**103
# Float lists at least this long are checked and rounded by numpy after one exact pack.
_LONG_COLUMN = 512
# Flat int lists at least this long are encoded through numpy instead of per value.
_EXTRAS_FAST_INTS = 16
# ``marshal`` format 2 (no back-references) writes a list as b"[" + its count as a
# little-endian i32, then each element tagged by its *exact* type: b"i" + i32 for an int in
# signed 32-bit range, b"g" + f64 for a float. bool (b"T"/b"F"), int and float subclasses
# (numpy scalars: a buffer, tagged b"s") and everything else get another tag or are refused.
_MARSHAL_VERSION = 2
_MARSHAL_HEAD = 5
_MARSHAL_INTS = np.dtype([("tag", "S1"), ("value", "<i4")])
_MARSHAL_FLOATS = np.dtype([("tag", "S1"), ("value", "<f8")])


def _marshal_layout_holds() -> bool:
    """Whether this interpreter's marshal writes the layout ``_exact_column`` reads."""
    try:
        raw = marshal.dumps([7, -2, 2.5, True, 2**40], _MARSHAL_VERSION)
    except ValueError:  # pragma: no cover - a marshal without format 2
        return False
    return raw[:25] == (
        b"[\x05\x00\x00\x00i\x07\x00\x00\x00i\xfe\xff\xff\xffg" + struct.pack("<d", 2.5) + b"T"
    ) and raw[25:26] not in (b"i", b"g")


_MARSHAL_OK = _marshal_layout_holds()


def _exact_column(values: list[Any], layout: np.dtype) -> np.ndarray | None:
    """The values of a list whose every element is an exact ``int`` in signed 32-bit range
    (``_MARSHAL_INTS``) or an exact ``float`` (``_MARSHAL_FLOATS``), as a numpy view; None
    when any element is anything else (the caller's slower path then finds and names it).

    One C pass: marshal tags each element by exact type, so the tags alone decide. The check
    is sound: the first element that is not of the wanted kind starts at its fixed offset
    (every element before it has the fixed size) and carries another tag.
    """
    if not _MARSHAL_OK:
        return None
    try:
        raw = marshal.dumps(values, _MARSHAL_VERSION)
    except ValueError:  # an element marshal cannot write (a custom object, too deep)
        return None
    count, size = len(values), layout.itemsize
    tag = b"i" if layout is _MARSHAL_INTS else b"g"
    if len(raw) != _MARSHAL_HEAD + size * count or raw[_MARSHAL_HEAD::size].count(tag) != count:
        return None
    # A contiguous copy: numpy's reductions and casts run ~2x faster than on the strided view.
    return np.ascontiguousarray(np.frombuffer(raw, dtype=layout, offset=_MARSHAL_HEAD)["value"])


def _u64(value: Any, name: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise ValueError(f"{name} must be an unsigned 64-bit integer, got {value!r}")
    return _U64.pack(value)


def _text(value: Any, name: str = "value") -> bytes:
    if type(value) is not str:
        raise TypeError(f"{name}: expected text, got {type(value).__name__}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid UTF-8 text (lone surrogate at position {exc.start})"
        ) from None
    return _U64.pack(len(raw)) + raw


def _opt_text(value: str | None, name: str) -> bytes:
    return b"\x00" if value is None else b"\x01" + _text(value, name)


def digest_to_bytes(value: Any, name: str) -> bytes:
    """The 32 raw bytes of a lowercase SHA-256 hex digest; anything else is a ValueError."""
    if type(value) is str and len(value) == 64:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if raw.hex() == value:  # the round trip refuses upper case and whitespace
            return raw
    raise ValueError(f"{name} must be a lowercase SHA-256 hex digest")


def _as_list(values: Any, name: str, what: str) -> list[Any]:
    """A column given as some other iterable, as a list; a non-iterable is a TypeError naming it."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of {what}, got {type(values).__name__}")
    return list(values)


def _first_bad(values: Any, ok: np.ndarray) -> Any:
    return values[int(np.flatnonzero(~ok)[0])]


def _as_numpy(values: Any) -> Any:
    """Tensors become numpy arrays (bf16/fp16 widened to float32); anything else is returned."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype in (torch.bfloat16, torch.float16):
            values = values.float()
        return values.numpy()
    return values


def token_id_bytes(
    token_ids: Any, name: str = "token_id", *, check_types: bool = True
) -> tuple[int, bytes]:
    """``(count, big-endian u64 bytes)`` of a token column, validated as exact u64 ints.

    A list of exact ints below 2**31 is read by one ``marshal`` pass (``_exact_column``);
    any other list is packed in one C-level ``struct`` call (exact ``int`` only: ``bool`` is
    rejected, as in the reference; ``check_types=False`` skips that scan for a list a strict
    pydantic field already validated); integer tensors and arrays go through one numpy
    byte-swap.
    """
    token_ids = _as_numpy(token_ids)
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu" or token_ids.ndim != 1:
            raise ValueError(f"{name} values must be a 1-D integer column, got {token_ids.dtype}")
        if token_ids.size and token_ids.dtype.kind == "i" and token_ids.min() < 0:
            bad = token_ids[int(np.argmin(token_ids))]
            raise ValueError(f"{name} must be an unsigned 64-bit integer, got {int(bad)}")
        return token_ids.size, token_ids.astype(">u8", copy=False).tobytes()
    if type(token_ids) is not list:
        token_ids = _as_list(token_ids, name, "ints")
    exact = _exact_column(token_ids, _MARSHAL_INTS)
    if exact is not None:
        if exact.size and exact.min() < 0:
            bad = token_ids[int(np.argmax(exact < 0))]
            raise ValueError(f"{name} must be an unsigned 64-bit integer, got {bad!r}")
        return exact.size, exact.astype(">u8").tobytes()
    if check_types and set(map(type, token_ids)) - {int}:
        bad = next(v for v in token_ids if type(v) is not int)
        raise ValueError(f"{name} must be an unsigned 64-bit integer, got {bad!r}")
    try:
        return len(token_ids), struct.pack(f">{len(token_ids)}Q", *token_ids)
    except (struct.error, TypeError):
        bad = next(v for v in token_ids if type(v) is not int or not 0 <= v <= _U64_MAX)
        raise ValueError(f"{name} must be an unsigned 64-bit integer, got {bad!r}") from None


def _float32_fits(value: float) -> bool:
    try:
        _F32.pack(value)
    except OverflowError:
        return False
    return True


def float32_bytes(values: Any, name: str, *, check_types: bool = True) -> tuple[Any, bytes]:
    """``(values, big-endian float32 bytes)`` of a float column: finite, float32-representable.

    A list of exact Python floats is read as float64 by one ``marshal`` pass
    (``_exact_column``), then checked and rounded to float32 (nearest-even) by numpy; other
    lists go through a C-level ``struct`` pack. The returned values keep the caller's float64
    values, so the {0.0, 1.0} mask and carry rules see what was written. Float tensors /
    arrays are cast by numpy.
    """
    values = _as_numpy(values)
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "f" or values.ndim != 1:
            raise ValueError(f"{name} values must be a 1-D float column, got {values.dtype}")
        return values, _float32_of_exact(values, values, name)
    if type(values) is not list:
        values = _as_list(values, name, "floats")
    exact = _exact_column(values, _MARSHAL_FLOATS)
    if exact is not None:
        return exact, _float32_of_exact(exact, values, name)
    if check_types and set(map(type, values)) - {float}:
        bad = next(v for v in values if type(v) is not float)
        raise ValueError(f"{name} values must be finite Python floats, got {bad!r}")
    try:
        return _float_list_bytes(values, name)
    except (TypeError, struct.error):  # unchecked types: a value that is not a number
        bad = next(v for v in values if not isinstance(v, (int, float)))
        raise ValueError(f"{name} values must be finite Python floats, got {bad!r}") from None


def _all_float32(exact: np.ndarray) -> bool:
    """Whether every value is finite and float32-representable: one pair of reductions
    catches all three faults (NaN propagates; inf and overflow reach the float32 limit)."""
    return exact.size == 0 or (
        -_F32_OVERFLOW < float(exact.min()) <= float(exact.max()) < _F32_OVERFLOW
    )


def _float32_of_exact(exact: np.ndarray, values: Any, name: str) -> bytes:
    """Big-endian float32 bytes of the float array ``exact`` (``values``' own numbers): finite
    and float32-representable, else a ValueError naming the first bad value."""
    if not _all_float32(exact):
        finite = np.isfinite(exact)
        if not finite.all():
            raise ValueError(
                f"{name} values must be finite Python floats, got {_first_bad(values, finite)!r}"
            )
        bad = float(values[int(np.argmax(np.abs(exact) >= _F32_OVERFLOW))])
        raise ValueError(f"{name} value cannot be represented as float32: {bad!r}")
    return exact.astype(">f4").tobytes()


def _float_pair(mask: Any, logprobs: Any) -> tuple[np.ndarray, bytes, np.ndarray, bytes] | None:
    """Both float columns through one check and one cast: two lists of exact floats (one list
    read) or two 1-D float arrays of one dtype (one concatenation), every value finite and
    float32-representable; None for anything else, which then goes column by column."""
    if type(mask) is list and type(logprobs) is list:
        exact = _exact_column(mask + logprobs, _MARSHAL_FLOATS)
    elif (
        type(mask) is np.ndarray
        and type(logprobs) is np.ndarray
        and mask.dtype == logprobs.dtype
        and mask.dtype.kind == "f"
        and mask.ndim == logprobs.ndim == 1
    ):
        exact = np.concatenate((mask, logprobs))
    else:
        return None
    if exact is None or not _all_float32(exact):
        return None
    raw, n = exact.astype(">f4").tobytes(), len(mask)
    return exact[:n], raw[: 4 * n], exact[n:], raw[4 * n :]


def _float_list_bytes(values: list[Any], name: str) -> tuple[Any, bytes]:
    if len(values) >= _LONG_COLUMN:
        # One C-level pack to exact float64 bytes, then numpy does the checks and the rounding.
        exact = np.frombuffer(struct.pack(f">{len(values)}d", *values), dtype=">f8")
        return exact, _float32_of_exact(exact, values, name)
    if not math.isfinite(sum(values)):  # a NaN or inf makes the sum non-finite (so may overflow)
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(f"{name} values must be finite Python floats, got {bad!r}")
    try:
        return values, struct.pack(f">{len(values)}f", *values)
    except OverflowError:
        bad = next(v for v in values if not _float32_fits(v))
        raise ValueError(f"{name} value cannot be represented as float32: {bad!r}") from None


_CARRY_RULE = (
    "prompt-carry log probabilities must be 0.0 "
    "(generation_log_probs_delta where token_mask_delta is 0.0)"
)


def _check_mask_and_carry(mask: Any, logprobs: Any) -> None:
    """Masks are 0.0 / 1.0 only; a carry position (mask 0.0) has logprob 0.0 (either sign)."""
    if type(mask) is list and type(logprobs) is list:
        zeros, ones = mask.count(0.0), mask.count(1.0)
        if zeros + ones != len(mask):
            raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
        if zeros and ones and mask.index(1.0) != zeros:  # carry not all leading: scan it all
            carry = any(compress(logprobs, map(not_, mask)))
        else:
            carry = any(logprobs[:zeros]) if ones else any(logprobs)
        if carry:
            raise ValueError(_CARRY_RULE)
        return
    mask, logprobs = np.asarray(mask), np.asarray(logprobs)
    carry = mask == 0.0
    zeros = np.count_nonzero(carry)
    if zeros + np.count_nonzero(mask == 1.0) != mask.size:
        raise ValueError("token_mask_delta must contain only 0.0 or 1.0")
    if zeros and logprobs[carry].any():  # -0.0 is falsy: either sign passes
        raise ValueError(_CARRY_RULE)


def encode_token_ids(token_ids: Any, *, check_types: bool = True) -> bytes:
    """``TOKENS(ids)``: the count, then every id as big-endian u64."""
    count, raw = token_id_bytes(token_ids, check_types=check_types)
    return _U64.pack(count) + raw
