"""The staging digest scheme (wire versions 2/2/1), byte-compatible with NeMo-Gym 0.7.0.

Every hash is SHA-256 over an ASCII domain tag followed directly by a payload. Token and
float columns are encoded a whole column at a time, never one Python value at a time:
tensors and arrays through one numpy big-endian cast; Python lists (what records hold)
through one C-level ``marshal`` pass that both proves every element's exact type and yields
its bytes, which numpy then checks and casts (see ``_exact_column``); lists that pass cannot
take that road (ids of 2**31 or more, wrong types) fall back to ``struct``.

The encodings, in the reference's words: ``U64`` is 8 bytes big-endian unsigned; ``TEXT``
is ``U64(len) + utf8``; ``TOKENS`` is ``U64(count)`` then each id as ``U64``; ``F32S`` is
``U64(count)`` then each value's IEEE-754 binary32 bit pattern, big-endian, after
round-to-nearest-even from float64. A ``-0.0`` keeps its sign bit, so it hashes apart
from ``0.0``; values that differ only below float32 precision hash alike.
"""

from __future__ import annotations

import hashlib
import marshal
import math
import struct
from collections.abc import Mapping
from itertools import compress
from operator import not_
from typing import Any

import numpy as np
import torch

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

CALL_DOMAIN = b"nemo-gym-staging-call-v2"
EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
PREFIX_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"

CAPTURE_MODES = ("text", "token_in")
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


def hash_token_ids(token_ids: Any, *, check_types: bool = True) -> str:
    """The cumulative hash: SHA-256(prefix-v2 tag ‖ TOKENS(ids)); an empty list is allowed."""
    return hash_token_id_bytes(*token_id_bytes(token_ids, check_types=check_types))


def hash_token_id_bytes(count: int, *raw: bytes) -> str:
    """``hash_token_ids`` of ``count`` ids already encoded (``token_id_bytes``), as the
    concatenation of the ``raw`` parts (a chain's deltas, each encoded once)."""
    return hashlib.sha256(b"".join((PREFIX_DOMAIN, _U64.pack(count), *raw))).hexdigest()


def compute_chain_hash(
    parent_chain_hash: str | None, token_ids_delta: Any, *, check_types: bool = True
) -> str:
    """chain_N = SHA-256(chain-v1 ‖ (0x00 | 0x01 + parent bytes) ‖ TOKENS(delta_N)).

    The marker byte keeps a root's chain hash apart from any child's.
    """
    count, raw = token_id_bytes(token_ids_delta, check_types=check_types)
    return chain_hash_of_bytes(parent_chain_hash, count, raw)


def chain_hash_of_bytes(parent_chain_hash: str | None, count: int, raw: bytes) -> str:
    """``compute_chain_hash`` of a delta of ``count`` ids already encoded (``token_id_bytes``)."""
    if parent_chain_hash is None:
        parent = b"\x00"
    else:
        parent = b"\x01" + digest_to_bytes(parent_chain_hash, "parent_chain_hash")
    return hashlib.sha256(b"".join((CHAIN_DOMAIN, parent, _U64.pack(count), raw))).hexdigest()


def _encode_extras_value(value: Any, out: list[bytes]) -> None:
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif kind is int:
        if not _I64_MIN <= value <= _I64_MAX:
            raise ValueError("extras integer is outside signed 64-bit range")
        out.append(b"I" + _I64.pack(value))
    elif kind is float:
        if not math.isfinite(value):
            raise ValueError("extras floats must be finite")
        out.append(b"F" + _F64.pack(value))
    elif kind is str:
        out.append(b"S" + _text(value, "extras text"))
    elif kind is list:
        out.append(b"L" + _U64.pack(len(value)))
        if len(value) >= _EXTRAS_FAST_INTS and set(map(type, value)) == {int}:
            packed = _pack_int_list(value)
            if packed is not None:
                out.append(packed)
                return
        for item in value:
            _encode_extras_value(item, out)
    elif kind is dict:
        entries = []
        for key in value:
            if type(key) is not str:
                raise TypeError("extras mappings must have string keys")
            entries.append((_text(key, "extras key")[_U64.size :], key))
        entries.sort()
        out.append(b"D" + _U64.pack(len(entries)))
        for raw, key in entries:
            out.append(_U64.pack(len(raw)) + raw)
            _encode_extras_value(value[key], out)
    else:
        raise TypeError(f"extras contain unsupported value type {kind.__name__}")


def _pack_int_list(values: list[int]) -> bytes | None:
    """``I`` + signed big-endian i64 per value, for a whole list at once (None: out of range)."""
    try:
        ints = np.asarray(values, dtype=">i8")
    except OverflowError:
        return None
    packed = np.empty(ints.size, dtype=[("tag", "S1"), ("value", ">i8")])
    packed["tag"] = b"I"
    packed["value"] = ints
    return packed.tobytes()


def encode_extras(extras: Mapping[str, Any] | None) -> bytes:
    """The typed, tag-byte encoding of an extras value (exact types; dict keys sorted by UTF-8)."""
    if extras is not None:
        if not isinstance(extras, Mapping):
            raise TypeError(f"extras must be a mapping or None, got {type(extras).__name__}")
        extras = dict(extras)
    out: list[bytes] = []
    _encode_extras_value(extras, out)
    return b"".join(out)


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """SHA-256(extras-v1 ‖ 0x01 ‖ ENC(extras)): None and {} hash apart, as do 1, 1.0, True."""
    return hashlib.sha256(EXTRAS_DOMAIN + b"\x01" + encode_extras(extras)).hexdigest()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)


def _check_identity(
    *,
    schema_version: Any,
    digest_version: Any,
    extras_digest_version: Any,
    rollout_id: Any,
    model_call_id: Any,
    parent_call_id: Any,
    mode: Any,
    prev_len: Any,
) -> None:
    if type(schema_version) is not int or schema_version != STAGING_SCHEMA_VERSION:
        raise ValueError(f"schema_version: unsupported staging schema version {schema_version!r}")
    if type(digest_version) is not int or digest_version != STAGING_DIGEST_VERSION:
        raise ValueError(f"digest_version: unsupported staging digest version {digest_version!r}")
    if type(extras_digest_version) is not int or extras_digest_version != EXTRAS_DIGEST_VERSION:
        raise ValueError(
            f"extras_digest_version: unsupported extras digest version {extras_digest_version!r}"
        )
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be non-empty when present")
    if mode not in CAPTURE_MODES:
        raise ValueError(f"mode: unsupported capture mode {mode!r}")
    if parent_call_id is None and (mode != "text" or prev_len != 0):
        raise ValueError(
            "a parentless call must be a text-mode root with prev_len == 0 "
            f"(parent_call_id None, mode {mode!r}, prev_len {prev_len!r})"
        )
    if parent_call_id is not None and (mode != "token_in" or not prev_len):
        raise ValueError(
            "a child call must use token_in mode with prev_len > 0 "
            f"(parent_call_id set, mode {mode!r}, prev_len {prev_len!r})"
        )


def staging_digest_and_columns(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Any,
    token_mask_delta: Any,
    generation_log_probs_delta: Any,
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
    check_types: bool = True,
) -> tuple[str, bytes, bytes, bytes]:
    """The staging digest plus the exact big-endian column bytes it covers.

    Returns ``(digest, ids u64 bytes, mask float32 bytes, logprob float32 bytes)``, so a
    writer can store precisely the bits the digest vouches for. ``check_types=False`` skips
    the exact-type scans of list columns that strict pydantic fields already validated
    (values are still range-, finiteness- and rule-checked).
    """
    _check_identity(
        schema_version=schema_version,
        digest_version=digest_version,
        extras_digest_version=extras_digest_version,
        rollout_id=rollout_id,
        model_call_id=model_call_id,
        parent_call_id=parent_call_id,
        mode=mode,
        prev_len=prev_len,
    )
    count, ids_raw = token_id_bytes(token_ids_delta, "token_ids_delta", check_types=check_types)
    pair = _float_pair(_as_numpy(token_mask_delta), _as_numpy(generation_log_probs_delta))
    if pair is None:  # column by column, naming any culprit
        mask, mask_raw = float32_bytes(
            token_mask_delta, "token_mask_delta", check_types=check_types
        )
        logprobs, logprob_raw = float32_bytes(
            generation_log_probs_delta, "generation_log_probs_delta", check_types=check_types
        )
    else:
        mask, mask_raw, logprobs, logprob_raw = pair
    if type(delta_len) is not int or delta_len < 1:
        raise ValueError(
            f"a staged call delta must contain at least one token (delta_len {delta_len!r})"
        )
    if delta_len != count:
        raise ValueError(f"delta_len {delta_len} does not match {count} token IDs")
    if not count == len(mask) == len(logprobs):
        raise ValueError(
            "token IDs, masks, and log probabilities must have equal lengths (token_ids_delta "
            f"{count}, token_mask_delta {len(mask)}, generation_log_probs_delta {len(logprobs)})"
        )
    _check_mask_and_carry(mask, logprobs)
    if type(prev_len) is int and type(cum_len) is int and cum_len != prev_len + delta_len:
        raise ValueError(
            f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})"
        )
    extras_raw = digest_to_bytes(extras_digest, "extras_digest")
    chain_raw = digest_to_bytes(chain_hash, "chain_hash")
    cumulative_raw = digest_to_bytes(cumulative_hash, "cumulative_hash")
    # Each column is framed as U64(len(TOKENS/F32S)) + U64(count) + its bytes; one join, one
    # hash, no intermediate copies of the columns.
    payload = b"".join(
        (
            CALL_DOMAIN,
            bytes((schema_version, digest_version, extras_digest_version)),
            _text(rollout_id, "rollout_id"),
            _text(model_call_id, "model_call_id"),
            _opt_text(parent_call_id, "parent_call_id"),
            _text(mode, "mode"),
            _u64(prev_len, "prev_len"),
            _u64(delta_len, "delta_len"),
            _u64(cum_len, "cum_len"),
            _u64(weight_version, "weight_version"),
            _FRAME.pack(_U64.size + len(ids_raw), count),
            ids_raw,
            _FRAME.pack(_U64.size + len(mask_raw), count),
            mask_raw,
            _FRAME.pack(_U64.size + len(logprob_raw), count),
            logprob_raw,
            extras_raw,
            b"\x01",
            chain_raw,
            b"\x01",
            cumulative_raw,
        )
    )
    return hashlib.sha256(payload).hexdigest(), ids_raw, mask_raw, logprob_raw


def compute_staging_digest(**fields: Any) -> str:
    """The per-call digest over identity, lengths, the three delta columns and the hashes.

    Keyword-only, with exactly the reference's argument names (``schema_version``, …,
    ``cumulative_hash``). Columns may be Python lists (exact ints / floats, as the records
    hold them) or 1-D tensors / arrays (the staging wire's int64 and float32 columns); both
    hash the same. ``staging_key``, extras bytes and attachments are not covered; extras
    are bound only through ``extras_digest``.
    """
    return staging_digest_and_columns(**fields)[0]
