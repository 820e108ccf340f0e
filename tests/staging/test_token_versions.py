"""The per-token version ledger (``token_versions``): staged beside the token columns, covered by
the call's digest (through its extras digest), read back and verified through ``TQTokenSource``,
linearized into the training row; a call without one keeps the digest it always had."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    TOKEN_VERSIONS_FIELD,
    CaptureAdmission,
    RolloutReassembler,
    TQTokenSink,
    TQTokenSource,
    compute_extras_digest,
    make_rollout_receipt,
    make_staged_call_record,
    register_staging_partition,
)
from tq_plugin.staging.records import recompute_digest
from tq_plugin.staging.store import TQStagingStore

PARTITION = "rollout_staging"


@pytest.fixture
def dp() -> LocalDataPlane:
    client = LocalDataPlane()
    register_staging_partition(client, PARTITION)
    return client


def _root(rollout: str = "r0", **kwargs):
    return make_staged_call_record(
        CaptureAdmission(rollout_id=rollout, model_call_id="c0", mode="text"),
        prompt_ids=[1, 2, 3], generated_ids=[4, 5, 6], generated_logprobs=[-0.5, -0.25, -1.0],
        weight_version=7, **kwargs)


def _child(parent, versions):
    admission = CaptureAdmission(
        rollout_id=parent.rollout_id, model_call_id="c1", parent_call_id="c0",
        prev_len=parent.cum_len, mode="token_in", staging_chain=[parent.staging_key],
        parent_chain_hash=parent.chain_hash)
    return make_staged_call_record(
        admission, prompt_ids=[1, 2, 3, 4, 5, 6, 9], prefix_token_ids=[1, 2, 3, 4, 5, 6],
        generated_ids=[10, 11], generated_logprobs=[-0.1, -0.2], weight_version=8,
        token_versions=versions)


def test_a_ledger_is_digest_covered_and_a_call_without_one_keeps_its_digest(dp) -> None:
    plain, ledgered = _root(), _root(token_versions=[7, 7, 8])
    assert plain.extras is None and plain.extras_digest == compute_extras_digest(None)
    assert ledgered.extras == {"token_versions": [7, 7, 8]}
    assert ledgered.digest != plain.digest  # the ledger is part of what the digest vouches for
    assert _root(token_versions=[7, 8, 8]).digest != ledgered.digest


def test_the_ledger_reads_back_verified_through_the_source(dp) -> None:
    sink = TQTokenSink(dp, staging_partition=PARTITION)
    ledgered, plain = _root("a", token_versions=[7, 7, 8]), _root("b")
    assert sink.stage(ledgered).ok and sink.stage(plain).ok
    row = TQStagingStore(dp, staging_partition=PARTITION).get(["a/c0"], select_fields=[TOKEN_VERSIONS_FIELD])
    held = row[TOKEN_VERSIONS_FIELD]
    assert (held.values() if held.is_nested else held[0]).tolist() == [7, 7, 8]  # a column
    source = TQTokenSource(dp, staging_partition=PARTITION)
    assert source.fetch_token_versions(["a/c0", "b/c0"]) == [[7, 7, 8], None]
    fetched = source.fetch_for_finalization(["a/c0"])[0]
    assert fetched.extras == {"token_versions": [7, 7, 8]}
    assert fetched.snapshot.digest == ledgered.digest


def test_a_tampered_ledger_fails_verification(dp) -> None:
    sink = TQTokenSink(dp, staging_partition=PARTITION)
    assert sink.stage(_root("a", token_versions=[7, 7, 8])).ok
    dp.put_samples(partition_id=PARTITION, sample_ids=["a/c0"],
                   fields={TOKEN_VERSIONS_FIELD: torch.tensor([[7, 8, 8]])})
    with pytest.raises(ValueError, match="extras_digest"):
        TQTokenSource(dp, staging_partition=PARTITION).fetch_token_versions(["a/c0"])


@pytest.mark.parametrize(("versions", "rule"), [
    ([7, 7], "has 2 entries for 3 generated tokens"),
    ([7, 7, 8, 8], "has 4 entries for 3 generated tokens"),
    ([7, -1, 8], "must be non-negative"),
    ([7, 7.0, 8], "must hold ints only, got float"),
    ([7, True, 8], "must hold ints only, got bool"),
])
def test_bad_ledgers_are_refused_naming_the_field_and_nothing_is_written(
        dp, versions, rule) -> None:
    with pytest.raises(ValueError, match=f"token_versions {rule}|token_versions: {rule}|{rule}"):
        _root(token_versions=versions)
    # A record that skipped validation (model_copy) is refused by the sink, nothing written.
    good = _root(token_versions=[7, 7, 8])
    bad = good.model_copy(update={"extras": {"token_versions": versions},
                                  "extras_digest": compute_extras_digest({"token_versions": versions})})
    bad = bad.model_copy(update={"digest": recompute_digest(bad)})  # every digest consistent
    result = TQTokenSink(dp, staging_partition=PARTITION).stage(bad)
    assert not result.ok and "token_versions" in result.error
    assert dp.list_sample_ids(PARTITION) == []


def test_the_training_row_carries_each_tokens_version(dp) -> None:
    sink = TQTokenSink(dp, staging_partition=PARTITION)
    root = _root("a", token_versions=[7, 7, 8])
    child = _child(root, [8, 9])
    plain = _root("b")
    for record in (root, child, plain):
        assert sink.stage(record).ok
    dp.register_partition(partition_id="train", fields=[])
    meta = RolloutReassembler(dp, staging_partition=PARTITION).finalize_group(
        [make_rollout_receipt([root, child], reward=1.0), make_rollout_receipt([plain], reward=0.0)],
        partition_id="train")
    td = dp.get_samples(partition_id="train", sample_ids=meta.sample_ids,
                        select_fields=[TOKEN_VERSIONS_FIELD, "token_mask"])
    versions = td[TOKEN_VERSIONS_FIELD]
    rows = [versions[i].tolist() for i in range(2)]
    # -1 on prompt tokens, the ledger on generated ones; a ledger-free call's version throughout
    assert rows[0] == [-1, -1, -1, 7, 7, 8, -1, 8, 9]
    assert rows[1] == [-1, -1, -1, 7, 7, 7]


def test_ledger_free_groups_keep_todays_columns(dp) -> None:
    sink = TQTokenSink(dp, staging_partition=PARTITION)
    plain = _root("b")
    assert sink.stage(plain).ok
    dp.register_partition(partition_id="train", fields=[])
    meta = RolloutReassembler(dp, staging_partition=PARTITION).finalize_group(
        [make_rollout_receipt([plain], reward=0.0)], partition_id="train")
    assert TOKEN_VERSIONS_FIELD not in meta.fields
