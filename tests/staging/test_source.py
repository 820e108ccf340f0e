"""TQTokenSource: one batched read, request order, KeyError instead of a short read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_plugin.staging import (
    STAGING_FIELDS,
    MediaMetadataIntegrityError,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    TQTokenSink,
    TQTokenSource,
    load_golden_vectors,
)

TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"


@pytest.fixture
def staged(text_sink, chain):
    records = chain(
        "r",
        [([1, 2], [3], [-0.5]), ([4], [5, 6], [-0.125, -0.25]), ([7], [8], [-0.375])],
        weight_versions=[1, 1, 2],
    )
    for record in records:
        assert text_sink.stage(record).ok
    return records


def test_fetch_returns_base_snapshots_equal_to_the_staged_records(
    staged, text_source, client
) -> None:
    keys = [r.staging_key for r in staged]
    snapshots = text_source.fetch(keys)
    assert [s.model_dump() for s in snapshots] == [r.model_dump(exclude={"extras"}) for r in staged]
    assert all(type(s) is StagedCallBaseSnapshot and not hasattr(s, "extras") for s in snapshots)
    assert len(client.of("get_samples")) == 1


def test_fetch_follows_request_order(staged, text_source) -> None:
    keys = ["r/c2", "r/c0", "r/c1"]
    assert [s.staging_key for s in text_source.fetch(keys)] == keys
    assert text_source.fetch([]) == []


def test_fetch_missing_key_raises_keyerror(staged, text_source) -> None:
    with pytest.raises(KeyError, match="could not be fetched"):
        text_source.fetch(["r/c0", "r/nope"])


def test_fetch_for_finalization_is_small_typed_and_identity_preserving(
    staged, text_source, client
) -> None:
    items = text_source.fetch_for_finalization(["r/c1"])
    assert client.of("get_samples")[0]["select_fields"] == list(STAGING_FIELDS)
    (item,) = items
    assert item.staging_key == "r/c1" and item.routed_len == 0 and item.fragment is None
    assert type(item.snapshot) is StagedCallBaseSnapshot


def test_fetch_for_finalization_rejects_duplicate_request_keys(staged, text_source, client) -> None:
    with pytest.raises(KeyError, match="duplicate keys"):
        text_source.fetch_for_finalization(["r/c0", "r/c0"])
    assert client.of("get_samples") == []


class _ShortReadClient:
    """A broken backend that silently drops the last requested row."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def get_samples(self, **kwargs):
        kwargs["sample_ids"] = kwargs["sample_ids"][:-1]
        return self.inner.get_samples(**kwargs)


def test_a_short_read_is_a_keyerror_never_a_shorter_list(staged, client) -> None:
    source = TQTokenSource(_ShortReadClient(client), staging_partition=TEXT_PARTITION)
    with pytest.raises(KeyError, match="staged rows missing"):
        source.fetch(["r/c0", "r/c1"])
    with pytest.raises(KeyError, match="prefix fetch incomplete"):
        source.fetch_prefix_token_ids(["r/c0", "r/c1"])


def test_a_row_stored_under_another_key_is_an_identity_mismatch(text_source, client, chain) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    TQTokenSink(client, staging_partition=TEXT_PARTITION).stage(record)
    row = client.inner.get_samples(
        sample_ids=["r/c0"], partition_id=TEXT_PARTITION, select_fields=STAGING_FIELDS
    )
    fields = {
        name: (row[name].values().unsqueeze(0) if row[name].is_nested else row[name])
        for name in STAGING_FIELDS
    }
    client.inner.put_samples(sample_ids=["r/other"], partition_id=TEXT_PARTITION, fields=fields)
    with pytest.raises(KeyError, match="identity mismatch"):
        text_source.fetch(["r/other"])


def test_fetch_prefix_token_ids(staged, text_source) -> None:
    assert text_source.fetch_prefix_token_ids([]) == []
    assert text_source.fetch_prefix_token_ids(["r/c0"]) == [1, 2, 3]
    full = text_source.fetch_prefix_token_ids(["r/c0", "r/c1", "r/c2"])
    assert full == [1, 2, 3, 4, 5, 6, 7, 8] and all(type(t) is int for t in full)
    with pytest.raises(KeyError):
        text_source.fetch_prefix_token_ids(["r/c0", "r/zz"])
    with pytest.raises(KeyError, match="duplicates"):
        text_source.fetch_prefix_token_ids(["r/c0", "r/c0"])


def test_route_fragments_ride_beside_snapshots_and_verify(text_sink, text_source, chain) -> None:
    routes = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    (record,) = chain("r", [([1], [2], [-1.0])], extras=[{"routed_experts": routes, "m": 1.5}])
    assert text_sink.stage(record).ok
    (deferred,) = text_source.fetch_for_finalization(["r/c0"])
    assert deferred.routed_len == 2 and deferred.fragment is None and deferred.extras == {"m": 1.5}
    (direct,) = text_source.fetch_for_finalization(["r/c0"], include_route_fragments=True)
    assert direct.fragment.routes.tolist() == routes and direct.fragment.routes.dtype == torch.int16
    assert "routed_experts" not in direct.snapshot.model_dump()
    direct.fragment.verify(record.extras_digest)
    with pytest.raises(ValueError, match="does not match"):
        direct.fragment.verify(direct.snapshot.digest)


def test_route_read_falls_back_to_the_base_selection_for_the_whole_batch(
    text_sink, text_source, chain
) -> None:
    (plain,) = chain("a", [([1], [2], [-1.0])])
    assert text_sink.stage(plain).ok
    (item,) = text_source.fetch_for_finalization(["a/c0"], include_route_fragments=True)
    assert item.fragment is None
    (routed,) = chain("b", [([1], [2], [-1.0])], extras=[{"routed_experts": [[[1]], [[2]]]}])
    assert text_sink.stage(routed).ok
    with pytest.raises(KeyError, match="routed_experts but its field is absent"):
        text_source.fetch_for_finalization(["a/c0", "b/c0"], include_route_fragments=True)


def test_media_metadata_tampering_is_detected(media_sink, media_source, client, chain) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])], extras=[{"media_spans": [1, 2]}])
    assert media_sink.stage(record).ok
    client.inner.put_samples(
        sample_ids=["r/c0"],
        partition_id=MEDIA_PARTITION,
        fields={
            "extras_metadata_json": torch.tensor([list(b'{"media_spans":[9]}')], dtype=torch.uint8)
        },
    )
    with pytest.raises(MediaMetadataIntegrityError, match="checksum mismatch"):
        media_source.fetch_for_finalization(["r/c0"])


def test_corrupted_token_bytes_fail_snapshot_validation(
    text_sink, text_source, client, chain
) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    assert text_sink.stage(record).ok
    client.inner.put_samples(
        sample_ids=["r/c0"],
        partition_id=TEXT_PARTITION,
        fields={"token_ids_delta": torch.tensor([[1, 9]])},
    )
    with pytest.raises(ValueError, match="digest does not match"):
        text_source.fetch(["r/c0"])


def test_route_free_extras_are_verified_against_the_extras_digest(
    text_sink, text_source, client, chain
) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])], extras=[{"a": 1}])
    assert text_sink.stage(record).ok
    assert text_source.fetch_for_finalization(["r/c0"])[0].extras == {"a": 1}
    client.inner.put_samples(
        sample_ids=["r/c0"],
        partition_id=TEXT_PARTITION,
        fields={"extras_metadata_json": torch.tensor([list(b'{"a":2}')], dtype=torch.uint8)},
    )
    with pytest.raises(ValueError, match="extras_digest"):
        text_source.fetch_for_finalization(["r/c0"])


def test_a_record_whose_extras_disagree_with_its_digest_is_not_staged(text_sink, client, chain):
    (record,) = chain("r", [([1], [2], [-1.0])], extras=[{"a": 1}])
    result = text_sink.stage(record.model_copy(update={"extras": {"a": 2}}))
    assert not result.ok and "extras_digest" in result.error
    assert client.of("put_samples") == []


def test_the_golden_vector_call_stages_and_fetches_byte_exact(text_sink, text_source) -> None:
    vectors = load_golden_vectors()
    golden = {**vectors["staged_call"], "digest": vectors["staged_call_digest"]}
    for version in ("schema_version", "digest_version", "extras_digest_version"):
        golden.pop(version)
    record = StagedCallRecord(**golden, extras=vectors["extras"])
    assert text_sink.stage(record).ok
    (item,) = text_source.fetch_for_finalization(["rollout-1/call-1"], include_route_fragments=True)
    assert item.snapshot.digest == golden["digest"] and item.routed_len == 2
    assert item.snapshot.model_dump() == record.model_dump(exclude={"extras"})
    item.fragment.verify(golden["extras_digest"])
    assert item.fragment.extras() == record.extras


def test_fetch_hashes_each_row_once_over_the_arrays_read(
    staged, text_source, monkeypatch
) -> None:
    """The source recomputes each digest over the fetched int64 / float32 arrays and hands it
    to the snapshot's validation, which then does not hash the lists a second time."""
    from tq_plugin.staging import records

    def list_rehash(record):
        raise AssertionError("the snapshot re-hashed its lists")

    monkeypatch.setattr(records, "recompute_digest", list_rehash)
    snapshots = text_source.fetch([r.staging_key for r in staged])
    assert [s.digest for s in snapshots] == [r.digest for r in staged]


def test_a_handed_digest_never_vouches_for_other_values(staged) -> None:
    """Validation skips its own hash only for the digest the row carries; any other handed
    digest, or columns that do not hash to the row's digest, get the usual check. The lists
    a snapshot holds are made from the very arrays that were hashed."""
    from tq_plugin.staging.records import _DIGEST_RECOMPUTED, validated_snapshot

    fields = staged[0].model_dump(exclude={"extras"})
    names = ["token_ids_delta", "token_mask_delta", "generation_log_probs_delta"]
    scalars = {k: v for k, v in fields.items() if k not in names}
    logprobs = [*fields["generation_log_probs_delta"][:-1], -0.75]
    tampered = {**fields, "generation_log_probs_delta": logprobs}
    with pytest.raises(ValueError, match="digest does not match"):
        StagedCallBaseSnapshot.model_validate(tampered, context={_DIGEST_RECOMPUTED: "0" * 64})
    dtypes = dict(zip(names, (np.int64, np.float32, np.float32)))
    good = {k: np.asarray(fields[k], dtype=dtypes[k]) for k in names}
    bad = {**good, "generation_log_probs_delta": np.asarray(logprobs, dtype=np.float32)}
    with pytest.raises(ValueError, match="digest does not match"):
        validated_snapshot(StagedCallBaseSnapshot, scalars, bad)
    assert validated_snapshot(StagedCallBaseSnapshot, scalars, good).model_dump() == fields
    with pytest.raises(ValueError, match="delta must contain at least one token"):
        validated_snapshot(StagedCallBaseSnapshot, {**scalars, "delta_len": 0}, good)


def test_jagged_columns_are_read_without_the_dispatched_values_call(
    staged, text_source, monkeypatch
) -> None:
    """``NestedTensor.values()`` costs ~16 us a call through Python dispatch; the source
    reads the flat tensor it aliases (falling back to ``values()`` where there is none)."""
    from torch.nested._internal.nested_tensor import NestedTensor

    from tq_plugin.staging.source import _jagged_values

    def dispatched(self):
        raise AssertionError("values() called")

    expected = [s.model_dump() for s in text_source.fetch([r.staging_key for r in staged])]
    monkeypatch.setattr(NestedTensor, "values", dispatched)
    got = text_source.fetch([r.staging_key for r in staged])
    assert [s.model_dump() for s in got] == expected
    assert text_source.fetch_prefix_token_ids([r.staging_key for r in staged]) == [
        t for r in staged for t in r.token_ids_delta
    ]

    class Other:
        def values(self):
            return torch.arange(3)

    assert _jagged_values(Other()).tolist() == [0, 1, 2]  # type: ignore[arg-type]


def test_a_batch_is_checked_once_and_its_snapshots_need_no_second_validation(
    staged, text_source, monkeypatch
) -> None:
    """The batch's token columns are checked and encoded once; each row then costs one hash
    over its slices, and a row whose slices hash to its digest is built without validating
    it again (that hash held every field to the model's rules). What comes back is what full
    validation builds."""
    keys = [r.staging_key for r in staged]
    validated = [
        StagedCallBaseSnapshot.model_validate(r.model_dump(exclude={"extras"})) for r in staged
    ]

    def revalidated(*args, **kwargs):
        raise AssertionError("a checked row was validated again")

    monkeypatch.setattr(StagedCallBaseSnapshot, "model_validate", revalidated)
    snapshots = text_source.fetch(keys)
    assert [s.model_dump() for s in snapshots] == [v.model_dump() for v in validated]
    assert [s.model_fields_set for s in snapshots] == [v.model_fields_set for v in validated]
    assert all(type(s) is StagedCallBaseSnapshot for s in snapshots)


@pytest.mark.parametrize(
    ("field", "row", "error"),
    [
        ("token_mask_delta", torch.tensor([[0.0, 0.5, 1.0]]), "only 0.0 or 1.0"),
        ("generation_logprobs_delta", torch.tensor([[0.0, -1.0, float("nan")]]), "finite"),
        ("generation_logprobs_delta", torch.tensor([[-1.0, -0.125, -0.25]]), "prompt-carry"),
        ("token_ids_delta", torch.tensor([[4, 5, -6]]), "must be non-negative"),
        ("token_mask_delta", torch.tensor([[0.0, 1.0]]), "equal lengths"),
    ],
)
def test_one_bad_row_fails_the_batch_with_its_own_error(
    staged, text_source, client, field, row, error
) -> None:
    """A value rule broken in one row of a batch (or rows of unequal lengths) sends the batch
    row by row, so the bad row raises exactly the error it raises alone."""
    client.inner.put_samples(partition_id=TEXT_PARTITION, sample_ids=["r/c1"], fields={field: row})
    with pytest.raises(ValueError, match=error):
        text_source.fetch([r.staging_key for r in staged])
    with pytest.raises(ValueError, match=error):
        text_source.fetch(["r/c1"])
    assert [s.digest for s in text_source.fetch(["r/c0", "r/c2"])] == [
        staged[0].digest,
        staged[2].digest,
    ]
