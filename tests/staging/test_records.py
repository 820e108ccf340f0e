"""Wire records: the reference validators, their wording, and round trips."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tq_plugin.staging import (
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
    build_staging_delta,
    call_record_for,
    staging_key,
)


def test_staging_key_is_rollout_slash_call_and_rejects_empty_parts() -> None:
    assert staging_key("r", "c") == "r/c"
    with pytest.raises(ValueError, match="must be non-empty"):
        staging_key("", "c")


def test_build_staging_delta_layout_and_errors() -> None:
    ids, mask, logprobs = build_staging_delta([1, 2, 3, 4], 2, [5, 6], [-0.5, -0.25])
    assert (ids, mask, logprobs) == ([3, 4, 5, 6], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, -0.5, -0.25])
    with pytest.raises(ValueError, match="outside prompt length"):
        build_staging_delta([1], 2, [5], [-0.5])
    with pytest.raises(ValueError, match="lengths differ"):
        build_staging_delta([1], 0, [5], [])


PARENT_HASH = "a" * 64


@pytest.mark.parametrize(
    "fields,match",
    [
        (
            {
                "mode": "token_in",
                "parent_call_id": "p",
                "prev_len": 2,
                "required_prefix_token_ids": [1],
                "parent_chain_hash": PARENT_HASH,
            },
            "length must equal prev_len",
        ),
        (
            {
                "mode": "token_in",
                "parent_call_id": "p",
                "prev_len": 1,
                "required_prefix_token_ids": [1],
            },
            "parent's chain hash",
        ),
        (
            {
                "mode": "token_in",
                "prev_len": 1,
                "required_prefix_token_ids": [1],
                "parent_chain_hash": PARENT_HASH,
            },
            "requires a parent_call_id",
        ),
        ({"mode": "text", "required_prefix_token_ids": [1]}, "text admission"),
        ({"mode": "text", "staging_chain": ["k"]}, "text admission"),
        ({"mode": "text", "parent_chain_hash": PARENT_HASH}, "text admission"),
        ({"mode": "text", "required_prefix_token_ids": [-1]}, "non-negative"),
    ],
)
def test_admission_rules(fields: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        CaptureAdmission(rollout_id="r", model_call_id="c", **fields)


def test_admission_with_a_staging_chain_skips_the_inline_length_check() -> None:
    fields = {"rollout_id": "r", "model_call_id": "c", "parent_call_id": "p", "prev_len": 2,
              "mode": "token_in", "required_prefix_token_ids": [1],
              "parent_chain_hash": PARENT_HASH}
    with pytest.raises(ValidationError, match="length must equal prev_len"):
        CaptureAdmission(**fields)
    admission = CaptureAdmission(**fields, staging_chain=["r/p"])
    assert admission.staging_chain == ["r/p"]
    assert (admission.prev_len, admission.required_prefix_token_ids) == (2, [1])


def test_staged_record_and_snapshot_round_trip(chain) -> None:
    root, child = chain(
        "r", [([1, 2], [3], [-0.5]), ([4], [5, 6], [-0.1, -0.2])], extras=[{"a": 1}, None]
    )
    base = root.to_base_snapshot()
    assert type(base) is StagedCallBaseSnapshot and base.staging_key == "r/c0"
    assert base.model_dump() == root.model_dump(exclude={"extras"})
    again = StagedCallRecord(**base.model_dump(), extras={"a": 1})
    assert again == root
    assert child.parent_call_id == "c0" and child.prev_len == root.cum_len


@pytest.mark.parametrize(
    "field,value",
    [
        ("schema_version", 1),
        ("schema_version", 3),
        ("digest_version", 1),
        ("digest_version", 3),
        ("extras_digest_version", 0),
        ("extras_digest_version", 2),
    ],
)
def test_wire_records_reject_old_and_new_versions(chain, field: str, value: int) -> None:
    (root,) = chain("r", [([1], [2], [-0.5])])
    with pytest.raises(ValidationError, match=field):
        StagedCallBaseSnapshot(**{**root.model_dump(exclude={"extras"}), field: value})


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"parent_call_id": "p"}, "child staged call must have prev_len > 0"),
        ({"mode": "token_in"}, "parentless staged call must use text mode"),
        ({"weight_version": 9}, "digest does not match"),
        ({"token_ids_delta": [1, 9]}, "digest does not match"),
        ({"token_ids_delta": [1, -2]}, "non-negative"),
        ({"token_mask_delta": [0.5, 1.0]}, "only 0.0 or 1.0"),
        ({"generation_log_probs_delta": [-1.0, -0.5]}, "prompt-carry"),
        ({"delta_len": 0}, "at least one token"),
        ({"extras": {"b": 2}}, "extras_digest does not match extras"),
        ({"extras": "x"}, "dict"),
        ({"token_ids_delta": [1.0, 2]}, "int"),
        ({"generation_log_probs_delta": [0.0, float("nan")]}, "finite"),
        ({"digest": "A" * 64}, "pattern"),
        ({"unknown": 1}, "Extra inputs"),
    ],
)
def test_staged_record_rejects_digest_covered_mutation(chain, changes: dict, match: str) -> None:
    (root,) = chain("r", [([1], [2], [-0.5])], extras=[{"a": 1}])
    with pytest.raises(ValidationError, match=match):
        StagedCallRecord(**{**root.model_dump(), **changes})


def test_records_accept_ints_as_floats_and_model_copy_bypasses_validation(chain) -> None:
    (root,) = chain("r", [([1], [2], [-1.0])])
    dumped = root.model_dump()
    dumped["token_mask_delta"] = [0, 1]
    dumped["generation_log_probs_delta"] = [0, -1]
    assert StagedCallRecord(**dumped).token_mask_delta == [0.0, 1.0]
    tampered = root.model_copy(update={"token_ids_delta": [7, 7]})
    assert tampered.token_ids_delta == [7, 7]


def test_base_snapshot_rejects_extras_and_defaults_the_empty_extras_digest(chain) -> None:
    (root,) = chain("r", [([1], [2], [-1.0])])
    with pytest.raises(ValidationError, match="extras"):
        StagedCallBaseSnapshot(**root.model_dump())
    assert root.extras_digest == EMPTY_EXTRAS_DIGEST


def test_stage_result_rules() -> None:
    with pytest.raises(ValidationError, match="requires an error"):
        StageResult(ok=False)
    with pytest.raises(ValidationError, match="requires staging_key"):
        StageResult(ok=True)
    assert StageResult(ok=True, staging_key="k", error="odd but allowed").ok
    assert not StageResult(ok=False, staging_key="k", error="e").ok


def _coords(**changes) -> CommitCoords:
    base = {
        "rollout_id": "r",
        "model_call_id": "c",
        "prev_len": 0,
        "delta_len": 2,
        "cum_len": 2,
        "weight_version": 0,
        "digest": "1" * 64,
        "extras_digest": "2" * 64,
        "staging_key": "r/c",
        "chain_hash": "3" * 64,
        "cumulative_hash": "4" * 64,
    }
    return CommitCoords(**{**base, **changes})


def test_coords_enforce_staged_and_failed_shapes() -> None:
    _coords()
    with pytest.raises(ValidationError, match="require digest"):
        _coords(chain_hash=None)
    with pytest.raises(ValidationError, match="cannot carry staged payload"):
        _coords(disposition="capture_failed", delta_len=0, cum_len=0)
    none = {
        "digest": None,
        "extras_digest": None,
        "staging_key": None,
        "chain_hash": None,
        "cumulative_hash": None,
    }
    _coords(disposition="capture_failed", delta_len=0, cum_len=0, **none)
    with pytest.raises(ValidationError, match="cannot carry token deltas"):
        _coords(disposition="capture_failed", **none)
    with pytest.raises(ValidationError, match="cum_len must equal"):
        _coords(cum_len=5)
    with pytest.raises(ValidationError, match="child coordinates"):
        _coords(parent_call_id="p")


def test_call_record_rules_and_the_token_in_default(chain) -> None:
    (root,) = chain("r", [([1], [2], [-1.0])])
    row = call_record_for(root)
    assert row.mode == "text" and row.staging_key == "r/c0"
    fields = row.model_dump()
    fields.pop("mode")
    with pytest.raises(ValidationError, match="parentless manifest row"):
        CallRecord(**fields)
    with pytest.raises(ValidationError, match="non-empty contiguous delta"):
        CallRecord(**{**row.model_dump(), "cum_len": 9})
    with pytest.raises(ValidationError, match="chain_hash"):
        CallRecord(**{**row.model_dump(), "chain_hash": None})


def _receipt(chain, **changes) -> RolloutReceipt:
    (root,) = chain("r", [([1], [2], [-1.0])])
    base = {
        "rollout_id": "r",
        "terminal_model_call_id": "c0",
        "manifest": [call_record_for(root)],
        "terminal_selection": "declared",
    }
    return RolloutReceipt(**{**base, **changes})


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"terminal_model_call_id": "zz"}, "absent from the receipt manifest"),
        ({"failure_reason": "x"}, "unpoisoned receipt cannot carry a failure_reason"),
        ({"terminal_selection": None}, "must name terminal_model_call_id"),
        ({"capture_poisoned": True, "terminal_selection": None}, "requires a terminal_selection"),
        (
            {"capture_poisoned": True, "terminal_selection": None, "terminal_model_call_id": None},
            "must be poisoned with a failure_reason",
        ),
        ({"terminal_selection": "guess"}, "terminal_selection"),
        ({"reward": float("inf")}, "finite"),
    ],
)
def test_rollout_receipt_rejects_inconsistent_attribution_state(
    chain, changes: dict, match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        _receipt(chain, **changes)


def test_rollout_receipt_accepts_poisoned_states(chain) -> None:
    _receipt(
        chain,
        capture_poisoned=True,
        terminal_selection=None,
        terminal_model_call_id=None,
        failure_reason="worker_capture_failed",
    )
    kept = _receipt(chain, capture_poisoned=True)
    assert kept.terminal_model_call_id == "c0"
    manifest = _receipt(chain).manifest
    with pytest.raises(ValidationError, match="duplicate model_call_id"):
        _receipt(chain, manifest=manifest * 2)
