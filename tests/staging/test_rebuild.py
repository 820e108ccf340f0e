"""verify_and_linearize: reason codes for every tampering, ancestry selection, determinism."""

from __future__ import annotations

import pytest

from tq_plugin.staging import (
    CaptureAdmission,
    RebuildError,
    ReceiptVerificationError,
    RolloutReceipt,
    call_record_for,
    make_staged_call_record,
    verify_and_linearize,
)


def _branched():
    root = make_staged_call_record(
        CaptureAdmission(rollout_id="r", model_call_id="root", mode="text"),
        prompt_ids=[10, 11],
        generated_ids=[12],
        generated_logprobs=[-0.1],
        weight_version=3,
    )

    def child(call, carry, generated, logprobs, wv):
        admission = CaptureAdmission(
            rollout_id="r",
            model_call_id=call,
            parent_call_id="root",
            prev_len=3,
            mode="token_in",
            required_prefix_token_ids=[10, 11, 12],
            parent_chain_hash=root.chain_hash,
        )
        return make_staged_call_record(
            admission,
            prompt_ids=[10, 11, 12, *carry],
            generated_ids=generated,
            generated_logprobs=logprobs,
            weight_version=wv,
        )

    main = child("main", [20], [21], [-0.2], 4)
    sibling = child("sibling", [30], [31, 32], [-0.3, -0.4], 99)
    records = [root, main, sibling]
    receipt = RolloutReceipt(
        rollout_id="r",
        reward=1.0,
        terminal_model_call_id="main",
        terminal_selection="declared",
        manifest=[call_record_for(r) for r in records],
    )
    return receipt, [r.to_base_snapshot() for r in records]


def _code(receipt, snapshots) -> str:
    with pytest.raises(ReceiptVerificationError) as info:
        verify_and_linearize(receipt, snapshots)
    assert str(info.value).startswith(info.value.code + ":")
    return info.value.code


def test_verify_and_linearize_selects_only_terminal_ancestry() -> None:
    row = verify_and_linearize(*_branched())
    assert row.token_ids == [10, 11, 12, 20, 21]
    assert row.token_mask == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert row.logprobs == [0.0, 0.0, -0.1, 0.0, -0.2]
    assert row.prompt_len == 2 and row.weight_versions == [3, 4]
    assert row.link_spans == [("root", 2, 1), ("main", 1, 1)]
    assert [(s.start, s.end) for s in row.weight_version_spans] == [(0, 3), (3, 5)]
    assert row.call_ids == ["root", "main"]
    assert [c.model_call_id for c in row.extras_commitments] == ["root", "main"]


def test_verification_is_retry_safe_and_deterministic() -> None:
    receipt, snapshots = _branched()
    assert verify_and_linearize(receipt, snapshots) == verify_and_linearize(receipt, snapshots)


TAMPERING = {
    "token_ids_delta": ([10, 11, 13], "corrupt_digest"),
    "token_mask_delta": ([0.0, 1.0, 1.0], "corrupt_digest"),
    "generation_log_probs_delta": ([0.0, 0.0, -0.5], "corrupt_digest"),
    "weight_version": (5, "wrong_weight_version"),
    "parent_call_id": ("x", "wrong_parent_call_id"),
    "prev_len": (1, "wrong_prev_len"),
    "cum_len": (4, "wrong_cum_len"),
    "mode": ("token_in", "wrong_mode"),
    "digest": ("0" * 64, "wrong_digest"),
    "extras_digest": ("0" * 64, "wrong_extras_digest"),
    "chain_hash": ("0" * 64, "wrong_chain_hash"),
    "cumulative_hash": ("0" * 64, "wrong_cumulative_hash"),
    "schema_version": (3, "wrong_schema_version"),
    "digest_version": (3, "wrong_digest_version"),
    "extras_digest_version": (2, "wrong_extras_digest_version"),
    "rollout_id": ("other", "wrong_rollout"),
    "model_call_id": ("ghost", "snapshot_identity_mismatch"),
}


@pytest.mark.parametrize("field", sorted(TAMPERING))
def test_snapshot_mutation_is_rejected(field: str) -> None:
    value, code = TAMPERING[field]
    receipt, snapshots = _branched()
    snapshots[0] = snapshots[0].model_copy(update={field: value})
    assert _code(receipt, snapshots) == code


def test_missing_extra_and_duplicate_rows_are_rejected() -> None:
    receipt, snapshots = _branched()
    assert _code(receipt, snapshots[:-1]) == "row_count_mismatch"
    assert _code(receipt, snapshots + snapshots[:1]) == "row_count_mismatch"
    assert _code(receipt, [snapshots[0], snapshots[0], snapshots[2]]) == "duplicate_snapshot"


def test_snapshot_order_binds_manifest_keys_to_identities() -> None:
    receipt, snapshots = _branched()
    assert _code(receipt, snapshots[::-1]) == "snapshot_order_mismatch"


def test_non_base_snapshot_values_are_rejected() -> None:
    receipt, snapshots = _branched()
    with pytest.raises(TypeError):
        verify_and_linearize(receipt, [s.model_dump() for s in snapshots])
    with pytest.raises(TypeError):
        verify_and_linearize(receipt.model_dump(), snapshots)


def test_poisoned_failed_and_unsupported_receipts_are_rejected() -> None:
    receipt, snapshots = _branched()
    assert (
        _code(receipt.model_copy(update={"capture_poisoned": True}), snapshots)
        == "capture_poisoned"
    )
    failed = receipt.model_copy(update={"capture_poisoned": True, "failure_reason": "x"})
    assert _code(failed, snapshots) == "rollout_failed"
    assert (
        _code(receipt.model_copy(update={"schema_version": 1}), snapshots) == "unsupported_schema"
    )
    assert (
        _code(receipt.model_copy(update={"digest_version": 1}), snapshots) == "unsupported_digest"
    )
    assert (
        _code(receipt.model_copy(update={"extras_digest_version": 2}), snapshots)
        == "unsupported_extras_digest"
    )
    assert _code(receipt.model_copy(update={"manifest": []}), []) == "empty_manifest"


def test_manifest_duplicates_are_rejected() -> None:
    receipt, snapshots = _branched()
    rows = receipt.manifest
    assert (
        _code(receipt.model_copy(update={"manifest": [rows[0], rows[0]]}), snapshots[:2])
        == "duplicate_manifest_row"
    )
    same_key = rows[1].model_copy(update={"staging_key": rows[0].staging_key})
    assert (
        _code(receipt.model_copy(update={"manifest": [rows[0], same_key]}), snapshots[:2])
        == "duplicate_staging_key"
    )


def test_missing_terminal_is_rejected() -> None:
    receipt, snapshots = _branched()
    with pytest.raises(RebuildError) as info:
        verify_and_linearize(receipt.model_copy(update={"terminal_model_call_id": None}), snapshots)
    assert info.value.code == "missing_terminal"


def test_missing_parent_and_empty_generation_are_rejected() -> None:
    receipt, snapshots = _branched()
    assert (
        _code(receipt.model_copy(update={"manifest": receipt.manifest[1:]}), snapshots[1:])
        == "missing_parent"
    )
    carry_only = make_staged_call_record(
        CaptureAdmission(rollout_id="r", model_call_id="root", mode="text"),
        prompt_ids=[10, 11, 12],
        generated_ids=[],
        generated_logprobs=[],
        weight_version=3,
    )
    lone = RolloutReceipt(
        rollout_id="r",
        terminal_model_call_id="root",
        terminal_selection="declared",
        manifest=[call_record_for(carry_only)],
    )
    assert _code(lone, [carry_only.to_base_snapshot()]) == "empty_generation"


def test_out_of_order_mask_is_rejected() -> None:
    from tq_plugin.staging import compute_staging_digest

    record = make_staged_call_record(
        CaptureAdmission(rollout_id="r", model_call_id="root", mode="text"),
        prompt_ids=[],
        generated_ids=[1, 2, 3],
        generated_logprobs=[-0.5, -0.5, -0.5],
        weight_version=0,
    )
    fields = record.model_dump(exclude={"extras", "digest"})
    fields.update(token_mask_delta=[1.0, 0.0, 1.0], generation_log_probs_delta=[-0.5, 0.0, -0.5])
    fields["digest"] = compute_staging_digest(**fields)
    snapshot = type(record.to_base_snapshot())(**fields)
    receipt = RolloutReceipt(
        rollout_id="r",
        terminal_model_call_id="root",
        terminal_selection="declared",
        manifest=[call_record_for(snapshot)],
    )
    assert _code(receipt, [snapshot]) == "invalid_mask_order"


def test_chained_receipt_verifies_and_broken_links_are_caught(chain) -> None:
    records = chain("r", [([1, 2], [3], [-0.5]), ([4], [5], [-0.5]), ([6], [7], [-0.5])])
    receipt = RolloutReceipt(
        rollout_id="r",
        terminal_model_call_id="c2",
        terminal_selection="declared",
        manifest=[call_record_for(r) for r in records],
    )
    snapshots = [r.to_base_snapshot() for r in records]
    assert verify_and_linearize(receipt, snapshots).token_ids == [1, 2, 3, 4, 5, 6, 7]

    from tq_plugin.staging import compute_staging_digest

    def reseal(index: int, **changes):
        """Tamper with one call consistently (row and snapshot agree, digest recomputed)."""
        fields = snapshots[index].model_dump(exclude={"digest"}) | changes
        fields["digest"] = compute_staging_digest(**fields)
        snaps, rows = list(snapshots), list(receipt.manifest)
        snaps[index] = type(snapshots[index])(**fields)
        rows[index] = call_record_for(snaps[index])
        return receipt.model_copy(update={"manifest": rows}), snaps

    assert _code(*reseal(1, chain_hash="0" * 64)) == "chain_hash_mismatch"
    assert _code(*reseal(2, cumulative_hash="0" * 64)) == "cumulative_hash_mismatch"
    assert (
        _code(*reseal(1, prev_len=2, cum_len=2 + records[1].delta_len)) == "parent_length_mismatch"
    )


def test_skipping_the_digest_recompute_still_checks_lineage_and_hashes() -> None:
    receipt, snapshots = _branched()
    row = verify_and_linearize(receipt, snapshots, recompute_digests=False)
    assert row == verify_and_linearize(receipt, snapshots)
    wrong_parent = [
        snapshots[0],
        snapshots[1].model_copy(update={"weight_version": 9}),
        snapshots[2],
    ]
    assert _code_without_recompute(receipt, wrong_parent) == "wrong_weight_version"
    bad_chain = [snapshots[0].model_copy(update={"token_ids_delta": [10, 11, 99]}), *snapshots[1:]]
    assert _code_without_recompute(receipt, bad_chain) == "chain_hash_mismatch"


def _code_without_recompute(receipt, snapshots) -> str:
    with pytest.raises(ReceiptVerificationError) as info:
        verify_and_linearize(receipt, snapshots, recompute_digests=False)
    return info.value.code
