"""``verify_and_linearize``: check a rollout's receipt against its fetched snapshots, then
concatenate the terminal's ancestry into one training row.

Fail-closed and deterministic (so retries are safe): every check raises a
``ReceiptVerificationError`` whose ``code`` is the reference's reason string. Snapshots
must cover every manifest row, dead siblings included, in manifest order. Snapshots may
be ours or Gym's own classes; both are read by attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tq_plugin.staging._gym import is_gym_instance
from tq_plugin.staging.digest import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    chain_hash_of_bytes,
    hash_token_id_bytes,
    token_id_bytes,
)
from tq_plugin.staging.records import RolloutReceipt, StagedCallBaseSnapshot, recompute_digest

_COMPARED_FIELDS = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
_VERSION_FIELDS = ("schema_version", "digest_version", "extras_digest_version")


class ReceiptVerificationError(ValueError):
    """A receipt and its snapshots do not verify; ``code`` is the wire reason string."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


class RebuildError(ReceiptVerificationError):
    """Graph and ancestry failures (missing parent, broken chain, bad mask order, ...)."""


@dataclass(frozen=True)
class WeightVersionSpan:
    """The span of one call's whole delta (carry and generation) in the linearized row."""

    model_call_id: str
    start: int
    end: int
    weight_version: int


@dataclass(frozen=True)
class ExtrasCommitment:
    """The receipt-bound digest any later-fetched extras of a call must match."""

    model_call_id: str
    extras_digest_version: int
    extras_digest: str


@dataclass(frozen=True)
class LinearizedRow:
    """One rollout's training row: the root-to-terminal deltas, concatenated."""

    rollout_id: str
    token_ids: list[int]
    token_mask: list[float]
    logprobs: list[float]
    model_call_ids: list[str]
    prompt_len: int
    weight_versions: list[int]
    weight_version_spans: list[WeightVersionSpan] = field(default_factory=list)
    link_spans: list[tuple[str, int, int]] = field(default_factory=list)
    extras_commitments: list[ExtrasCommitment] = field(default_factory=list)

    @property
    def call_ids(self) -> list[str]:
        return self.model_call_ids


def _is_snapshot(value: Any) -> bool:
    return isinstance(value, StagedCallBaseSnapshot) or is_gym_instance(
        value, "StagedCallBaseSnapshot"
    )


def _check_receipt_state(receipt: Any) -> None:
    if not (isinstance(receipt, RolloutReceipt) or is_gym_instance(receipt, "RolloutReceipt")):
        raise TypeError(
            f"verify_and_linearize needs a RolloutReceipt, got {type(receipt).__name__}"
        )
    for attr, expected, code in (
        ("schema_version", STAGING_SCHEMA_VERSION, "unsupported_schema"),
        ("digest_version", STAGING_DIGEST_VERSION, "unsupported_digest"),
        ("extras_digest_version", EXTRAS_DIGEST_VERSION, "unsupported_extras_digest"),
    ):
        if getattr(receipt, attr) != expected:
            raise ReceiptVerificationError(code, f"receipt {attr} is {getattr(receipt, attr)!r}")
    if receipt.failure_reason:
        raise ReceiptVerificationError("rollout_failed", str(receipt.failure_reason))
    if receipt.capture_poisoned:
        raise ReceiptVerificationError(
            "capture_poisoned", f"rollout {receipt.rollout_id!r} is poisoned"
        )
    if not receipt.manifest:
        raise ReceiptVerificationError(
            "empty_manifest", f"rollout {receipt.rollout_id!r} has no calls"
        )
    ids = [row.model_call_id for row in receipt.manifest]
    if len(set(ids)) != len(ids):
        raise ReceiptVerificationError(
            "duplicate_manifest_row", "model_call_id repeats in the manifest"
        )
    keys = [row.staging_key for row in receipt.manifest]
    if len(set(keys)) != len(keys):
        raise ReceiptVerificationError(
            "duplicate_staging_key", "staging_key repeats in the manifest"
        )


def _check_snapshots(receipt: Any, snapshots: Sequence[Any], *, recompute: bool) -> None:
    manifest = receipt.manifest
    if len(snapshots) != len(manifest):
        raise ReceiptVerificationError(
            "row_count_mismatch", f"{len(snapshots)} snapshots for {len(manifest)} manifest rows"
        )
    ids = {row.model_call_id for row in manifest}
    seen: set[str] = set()
    for row, snap in zip(manifest, snapshots):
        if not _is_snapshot(snap):
            raise TypeError(
                f"snapshots must be StagedCallBaseSnapshot values, got {type(snap).__name__}"
            )
        call = snap.model_call_id
        if call in seen:
            raise ReceiptVerificationError("duplicate_snapshot", f"{call!r} appears twice")
        seen.add(call)
        if call not in ids:
            raise ReceiptVerificationError(
                "snapshot_identity_mismatch", f"{call!r} is not in the manifest"
            )
        if call != row.model_call_id:
            raise ReceiptVerificationError(
                "snapshot_order_mismatch", f"position of {row.model_call_id!r} holds {call!r}"
            )
        if snap.rollout_id != receipt.rollout_id:
            raise ReceiptVerificationError(
                "wrong_rollout", f"{call!r} belongs to {snap.rollout_id!r}"
            )
        for name in _COMPARED_FIELDS:
            if getattr(snap, name) != getattr(row, name):
                raise ReceiptVerificationError(
                    f"wrong_{name}", f"{call!r} disagrees with its manifest row"
                )
        for name in _VERSION_FIELDS:
            if not getattr(snap, name) == getattr(row, name) == getattr(receipt, name):
                raise ReceiptVerificationError(f"wrong_{name}", f"{call!r} disagrees on {name}")
        if not recompute:
            continue
        try:
            digest = recompute_digest(snap)
        except Exception as exc:
            raise ReceiptVerificationError("invalid_snapshot", f"{call!r}: {exc}") from exc
        if digest != snap.digest:
            raise ReceiptVerificationError(
                "corrupt_digest", f"{call!r} columns do not match its digest"
            )


def _terminal_chain(receipt: Any) -> list[Any]:
    """Root-first rows from the root to the terminal, after the manifest graph checks."""
    rows = {row.model_call_id: row for row in receipt.manifest}
    for row in receipt.manifest:
        parent = row.parent_call_id
        if parent is None:
            continue
        if parent not in rows:
            raise RebuildError(
                "missing_parent", f"{row.model_call_id!r} names absent parent {parent!r}"
            )
        if rows[parent].cum_len != row.prev_len:
            raise RebuildError(
                "parent_length_mismatch",
                f"{row.model_call_id!r} prev_len {row.prev_len} != parent cum_len "
                f"{rows[parent].cum_len}",
            )
    for row in receipt.manifest:
        visited: set[str] = set()
        node = row
        while node.parent_call_id is not None:
            if node.model_call_id in visited:
                raise RebuildError("lineage_cycle", f"{row.model_call_id!r} lies on a parent cycle")
            visited.add(node.model_call_id)
            node = rows[node.parent_call_id]
    terminal = receipt.terminal_model_call_id
    if terminal is None or terminal not in rows:
        raise RebuildError("missing_terminal", f"terminal {terminal!r} is not in the manifest")
    chain = [rows[terminal]]
    while chain[-1].parent_call_id is not None:
        chain.append(rows[chain[-1].parent_call_id])
    return chain[::-1]


def verify_and_linearize(
    receipt: Any, snapshots: Sequence[Any], *, recompute_digests: bool = True
) -> LinearizedRow:
    """Verify every snapshot against the receipt, then linearize the terminal's ancestry.

    ``recompute_digests=False`` skips re-hashing each snapshot's columns; it is only for a
    caller that built the snapshots itself through normal validation (which recomputed the
    digest over the fetched bytes) and never handed them out, as the reassembler does. Every
    other check (identity, lineage, chain and cumulative hashes, mask order) still runs.
    """
    _check_receipt_state(receipt)
    _check_snapshots(receipt, snapshots, recompute=recompute_digests)
    chain = _terminal_chain(receipt)
    by_id = {snap.model_call_id: snap for snap in snapshots}
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    spans: list[WeightVersionSpan] = []
    links: list[tuple[str, int, int]] = []
    prompt_len = 0
    running: str | None = None
    encoded: list[bytes] = []  # each delta's ids encoded once: its chain hash, then the row's
    for position, row in enumerate(chain):
        snap = by_id[row.model_call_id]
        count, raw = token_id_bytes(snap.token_ids_delta, "token_ids_delta", check_types=False)
        encoded.append(raw)
        running = chain_hash_of_bytes(running, count, raw)
        if running != row.chain_hash:
            raise RebuildError("chain_hash_mismatch", f"{row.model_call_id!r} breaks the chain")
        mask_delta = list(snap.token_mask_delta)
        size = len(mask_delta)
        try:
            carry = mask_delta.index(1.0)
        except ValueError:
            carry = size
        if mask_delta.count(0.0) != carry or mask_delta.count(1.0) != size - carry:
            raise RebuildError(
                "invalid_mask_order", f"{row.model_call_id!r} mask is not carry-then-generation"
            )
        if carry == size:
            raise RebuildError("empty_generation", f"{row.model_call_id!r} generated no token")
        if position == 0:
            prompt_len = carry
        start = len(ids)
        ids.extend(snap.token_ids_delta)
        mask.extend(snap.token_mask_delta)
        logprobs.extend(snap.generation_log_probs_delta)
        spans.append(WeightVersionSpan(row.model_call_id, start, len(ids), row.weight_version))
        links.append((row.model_call_id, carry, size - carry))
    if 1.0 not in mask:
        raise RebuildError("empty_training_row", "no generated token on the terminal chain")
    if hash_token_id_bytes(len(ids), *encoded) != chain[-1].cumulative_hash:
        raise RebuildError(
            "cumulative_hash_mismatch", "the terminal's cumulative hash does not cover the row"
        )
    return LinearizedRow(
        rollout_id=receipt.rollout_id,
        token_ids=ids,
        token_mask=mask,
        logprobs=logprobs,
        model_call_ids=[row.model_call_id for row in chain],
        prompt_len=prompt_len,
        weight_versions=[row.weight_version for row in chain],
        weight_version_spans=spans,
        link_spans=links,
        extras_commitments=[
            ExtrasCommitment(row.model_call_id, row.extras_digest_version, row.extras_digest)
            for row in chain
        ],
    )
