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
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tq_plugin.staging.encoding import (  # the column encodings the digest hashes
    _EXTRAS_FAST_INTS,
    _F64,
    _FRAME,
    _I64,
    _I64_MAX,
    _I64_MIN,
    _U64,
    _all_float32,
    _as_numpy,
    _check_mask_and_carry,
    _float_pair,
    _opt_text,
    _text,
    _u64,
    digest_to_bytes,
    float32_bytes,
    token_id_bytes,
)

STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1

CALL_DOMAIN = b"nemo-gym-staging-call-v2"
EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"
PREFIX_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"

CAPTURE_MODES = ("text", "token_in")
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
    fields = {
        "schema_version": schema_version, "digest_version": digest_version,
        "extras_digest_version": extras_digest_version, "rollout_id": rollout_id,
        "model_call_id": model_call_id, "parent_call_id": parent_call_id, "mode": mode,
        "prev_len": prev_len, "delta_len": delta_len, "cum_len": cum_len,
        "weight_version": weight_version, "extras_digest": extras_digest,
        "chain_hash": chain_hash, "cumulative_hash": cumulative_hash,
    }
    digest = _call_digest(fields, (count, ids_raw, mask_raw, logprob_raw))
    return digest, ids_raw, mask_raw, logprob_raw


def _call_digest(fields: Mapping[str, Any], columns: tuple[int, bytes, bytes, bytes]) -> str:
    """The call digest over its three columns' checked bytes ``(count, ids, mask, logprobs)``:
    the cum_len rule and the digest fields' form are checked here, then one join, one hash."""
    count, ids_raw, mask_raw, logprob_raw = columns
    get = fields.get
    prev_len, delta_len, cum_len = get("prev_len"), get("delta_len"), get("cum_len")
    if type(prev_len) is int and type(cum_len) is int and cum_len != prev_len + delta_len:
        raise ValueError(
            f"cum_len {cum_len} does not equal prev_len + delta_len ({prev_len + delta_len})"
        )
    extras_raw = digest_to_bytes(fields.get("extras_digest"), "extras_digest")
    chain_raw = digest_to_bytes(fields.get("chain_hash"), "chain_hash")
    cumulative_raw = digest_to_bytes(fields.get("cumulative_hash"), "cumulative_hash")
    # Each column is framed as U64(len(TOKENS/F32S)) + U64(count) + its bytes; one join, one
    # hash, no intermediate copies of the columns.
    payload = b"".join(
        (
            CALL_DOMAIN,
            bytes((fields.get("schema_version"), fields.get("digest_version"),
                   fields.get("extras_digest_version"))),
            _text(fields.get("rollout_id"), "rollout_id"),
            _text(fields.get("model_call_id"), "model_call_id"),
            _opt_text(fields.get("parent_call_id"), "parent_call_id"),
            _text(fields.get("mode"), "mode"),
            _u64(prev_len, "prev_len"),
            _u64(delta_len, "delta_len"),
            _u64(cum_len, "cum_len"),
            _u64(fields.get("weight_version"), "weight_version"),
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
    return hashlib.sha256(payload).hexdigest()


def checked_column_bytes(
    token_ids: np.ndarray, token_mask: np.ndarray, log_probs: np.ndarray
) -> tuple[bytes, bytes, bytes] | None:
    """Big-endian bytes (u64 ids, float32 mask and logprobs) of whole columns of many calls,
    row-aligned (the caller checks that each row has one length in all three), once every value
    passes the value rules of a call's digest: ids non-negative, floats finite and
    float32-representable, masks 0.0 / 1.0 with logprob 0.0 at every carry (mask 0.0) position.

    None when any value breaks a rule (or a column is not a 1-D integer / float array): the
    caller then hashes row by row with ``staging_digest_and_columns``, which names the culprit.
    Row i's digest is ``digest_of_checked_row`` over its slices.
    """
    for column, kinds in ((token_ids, "iu"), (token_mask, "f"), (log_probs, "f")):
        if type(column) is not np.ndarray or column.ndim != 1 or column.dtype.kind not in kinds:
            return None
    if token_ids.size and token_ids.dtype.kind == "i" and token_ids.min() < 0:
        return None
    if not (_all_float32(token_mask) and _all_float32(log_probs)):
        return None
    carry = token_mask == 0.0
    zeros = np.count_nonzero(carry)
    if zeros + np.count_nonzero(token_mask == 1.0) != token_mask.size:
        return None
    if zeros and log_probs[carry].any():  # -0.0 is falsy: either sign passes, as row by row
        return None
    return (
        token_ids.astype(">u8", copy=False).tobytes(),
        token_mask.astype(">f4").tobytes(),
        log_probs.astype(">f4").tobytes(),
    )


def digest_of_checked_row(
    fields: Mapping[str, Any], count: int, ids_raw: bytes, mask_raw: bytes, logprob_raw: bytes
) -> str:
    """``compute_staging_digest`` of a call whose ``count`` tokens' column bytes
    ``checked_column_bytes`` checked and encoded; ``fields`` are its other digest inputs, held to
    ``staging_digest_and_columns``' rules (a ``TypeError`` or ``ValueError`` when one breaks
    them: hash the row with that function to have the culprit named)."""
    get = fields.get
    _check_identity(
        schema_version=get("schema_version"),
        digest_version=get("digest_version"),
        extras_digest_version=get("extras_digest_version"),
        rollout_id=get("rollout_id"),
        model_call_id=get("model_call_id"),
        parent_call_id=get("parent_call_id"),
        mode=get("mode"),
        prev_len=get("prev_len"),
    )
    delta_len = get("delta_len")
    if type(delta_len) is not int or delta_len < 1 or delta_len != count:
        raise ValueError(f"delta_len {delta_len!r} does not match {count} token IDs")
    return _call_digest(fields, (count, ids_raw, mask_raw, logprob_raw))


def compute_staging_digest(**fields: Any) -> str:
    """The per-call digest over identity, lengths, the three delta columns and the hashes.

    Keyword-only, with exactly the reference's argument names (``schema_version``, …,
    ``cumulative_hash``). Columns may be Python lists (exact ints / floats, as the records
    hold them) or 1-D tensors / arrays (the staging wire's int64 and float32 columns); both
    hash the same. ``staging_key``, extras bytes and attachments are not covered; extras
    are bound only through ``extras_digest``.
    """
    return staging_digest_and_columns(**fields)[0]
