"""TQTokenSink: one combined put per call, validation before any write, failures reported."""

from __future__ import annotations

import logging

import pytest
import torch

from tq_plugin.staging import (
    MEDIA_STAGING_FIELDS,
    STAGING_FIELDS,
    StagingSink,
    TQTokenSink,
    compute_staging_digest,
)

TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"


def _put_fields(client) -> list[set[str]]:
    return [set(put["fields"].keys()) for put in client.of("put_samples")]


def test_media_rows_round_trip_in_a_single_put(
    client, media_sink, media_source, chain, media
) -> None:
    still, vid, text = (chain(f"r{i}", [([1, 2], [3], [-0.5])])[0] for i in range(3))
    assert media_sink.stage(still, attachments=media.still()).ok
    assert media_sink.stage(vid, attachments=media.video(frames=1)).ok
    assert media_sink.stage(text).ok
    puts = _put_fields(client)
    assert len(puts) == 3
    assert all(set(STAGING_FIELDS) | set(MEDIA_STAGING_FIELDS) <= fields for fields in puts)
    for column in ("media_imgs", "media_imgs_sizes", "media_num_frames", "media_patch_size"):
        assert len({put["fields"][column].dtype for put in client.of("put_samples")}) == 1

    items = media_source.fetch_for_finalization(["r0/c0", "r1/c0", "r2/c0"])
    assert [(i.media_present, i.media_has_frames) for i in items] == [
        (True, False),
        (True, True),
        (False, False),
    ]
    client.calls.clear()
    (got_still,) = media_source.fetch_media(items[:1])
    (got_video,) = media_source.fetch_media(items[1:2])
    assert [set(g["select_fields"]) for g in client.of("get_samples")] == [
        {"media_imgs", "media_imgs_sizes", "media_num_frames", "media_patch_size"}
    ] * 2
    assert got_still.num_frames is None and got_video.num_frames.tolist() == [1]
    assert got_still.imgs.dtype == torch.bfloat16 and got_still.imgs.shape == (1, 4, 12)
    assert got_still.imgs_sizes.dtype == torch.int32

    client.calls.clear()
    with pytest.raises(ValueError, match="uniform media_has_frames"):
        media_source.fetch_media(items[:2])
    with pytest.raises(ValueError, match="media_present=True"):
        media_source.fetch_media(items)
    assert media_source.fetch_media([]) == []
    assert client.of("get_samples") == []


def test_staged_pixels_come_back_bit_exact_in_request_order(
    client, media_sink, media_source, chain, media
) -> None:
    bundles = [media.still(frames=n) for n in (1, 3, 2)]
    for i, bundle in enumerate(bundles):
        (record,) = chain(f"r{i}", [([1], [2], [-1.0])])
        assert media_sink.stage(record, attachments=bundle).ok
    keys = ["r2/c0", "r0/c0", "r1/c0"]
    items = media_source.fetch_for_finalization(keys)
    client.calls.clear()
    got = media_source.fetch_media(items)
    assert len(client.of("get_samples")) == 1
    for fetched, want in zip(got, [bundles[2], bundles[0], bundles[1]]):
        assert torch.equal(fetched.imgs, want["imgs"]) and torch.equal(
            fetched.imgs_sizes, want["imgs_sizes"]
        )


def test_text_only_partition_never_touches_media_columns(
    client, text_sink, text_source, chain, media
) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    assert text_sink.stage(record).ok
    assert not _put_fields(client)[0] & set(MEDIA_STAGING_FIELDS)
    (item,) = text_source.fetch_for_finalization(["r/c0"])
    assert set(client.of("get_samples")[0]["select_fields"]) == set(STAGING_FIELDS)
    assert (item.media_present, item.media_has_frames) == (False, False)
    with pytest.raises(ValueError, match="media-enabled"):
        text_source.fetch_media([item])
    (other,) = chain("r2", [([1], [2], [-1.0])])
    result = text_sink.stage(other, attachments=media.still())
    assert not result.ok and "media-enabled" in result.error
    assert len(client.of("put_samples")) == 1


@pytest.mark.parametrize(
    "attachments",
    [
        {},
        {"imgs": torch.zeros(1, 4, 12, dtype=torch.bfloat16)},
        {"imgs": torch.zeros(1, 4, 12, dtype=torch.float16), "imgs_sizes": torch.tensor([[4, 4]])},
        {"imgs": torch.zeros(1, 4, 11, dtype=torch.bfloat16), "imgs_sizes": torch.tensor([[4, 4]])},
        {"imgs": torch.zeros(1, 4, 12, dtype=torch.bfloat16), "imgs_sizes": torch.tensor([[4, 8]])},
        "not a mapping",
    ],
)
def test_malformed_media_fails_before_any_put(client, media_sink, chain, attachments) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    result = media_sink.stage(record, attachments=attachments)
    assert not result.ok and result.staging_key == "r/c0" and result.error
    assert client.of("put_samples") == [] and client.of("clear_samples") == []


def test_media_sink_needs_a_pixel_dtype(client) -> None:
    with pytest.raises(ValueError, match="media_pixel_dtype"):
        TQTokenSink(client, staging_partition=MEDIA_PARTITION, capture_media=True)


def test_failed_combined_write_discards_the_attempted_key(
    client, text_sink, text_source, chain
) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    client.fail_put = OSError("controller down")
    result = text_sink.stage(record)
    assert not result.ok and result.staging_key == "r/c0" and "controller down" in result.error
    assert [c["sample_ids"] for c in client.of("clear_samples")] == [["r/c0"]]
    with pytest.raises(KeyError):
        text_source.fetch(["r/c0"])


def test_cleanup_failure_still_reports_the_stage_failure(client, text_sink, chain, caplog) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    client.fail_put = OSError("put down")
    client.fail_clear = OSError("clear down")
    with caplog.at_level(logging.WARNING):
        result = text_sink.stage(record)
    assert not result.ok and "put down" in result.error
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "orphaned" in errors[0].getMessage()


def test_stage_never_raises_even_for_garbage(text_sink) -> None:
    result = text_sink.stage(object())
    assert not result.ok and result.staging_key is None and "AttributeError" in result.error


def test_a_tampered_record_is_refused_before_the_write(client, text_sink, chain) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    tampered = record.model_copy(update={"token_ids_delta": [1, 3]})
    result = text_sink.stage(tampered)
    assert not result.ok and "digest does not match" in result.error
    assert client.of("put_samples") == []


def test_token_ids_above_int64_are_rejected_with_a_clear_error(client, text_sink, chain) -> None:
    (record,) = chain("r", [([1], [2**63 + 5], [-1.0])])
    result = text_sink.stage(record)
    assert not result.ok and "int64" in result.error and str(2**63 + 5) in result.error
    assert client.of("put_samples") == []


def test_negative_zero_logprob_keeps_its_sign_bit(text_sink, text_source, chain) -> None:
    (record,) = chain("r", [([1], [2, 3], [-0.0, -0.5])])
    assert text_sink.stage(record).ok
    (snapshot,) = text_source.fetch(["r/c0"])
    assert str(snapshot.generation_log_probs_delta[1]) == "-0.0"
    assert snapshot.digest == record.digest


@pytest.mark.parametrize("value", [1, 1.0, True, {}, None, [1, 1.0, True], "é"])
def test_extras_json_round_trips_values_that_look_alike(
    text_sink, text_source, chain, value
) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])], extras=[{"v": value, "n": None}])
    assert text_sink.stage(record).ok
    (item,) = text_source.fetch_for_finalization(["r/c0"])
    assert item.extras == {"v": value, "n": None}
    assert repr(item.extras["v"]) == repr(value)


def test_none_and_empty_extras_stay_distinct(text_sink, text_source, chain) -> None:
    (none,) = chain("a", [([1], [2], [-1.0])], extras=[None])
    (empty,) = chain("b", [([1], [2], [-1.0])], extras=[{}])
    assert text_sink.stage(none).ok and text_sink.stage(empty).ok
    got = text_source.fetch_for_finalization(["a/c0", "b/c0"])
    assert got[0].extras is None and got[1].extras == {}


def test_float64_logprobs_are_hashed_as_float32_bits(text_sink, text_source, chain) -> None:
    (record,) = chain("r", [([1], [2], [-0.1])])
    assert text_sink.stage(record).ok
    (snapshot,) = text_source.fetch(["r/c0"])
    assert snapshot.generation_log_probs_delta[1] != -0.1  # the float32 value, widened
    assert (
        snapshot.digest
        == record.digest
        == compute_staging_digest(
            **{**snapshot.model_dump(exclude={"digest"}), "generation_log_probs_delta": [0.0, -0.1]}
        )
    )


def test_route_envelopes_are_refused_and_misaligned_routes_too(client, text_sink, chain) -> None:
    (env,) = chain("a", [([1], [2], [-1.0])], extras=[{"routed_experts": "b64:int16:..."}])
    (short,) = chain("b", [([1], [2], [-1.0])], extras=[{"routed_experts": [[[1, 2]]]}])
    assert "envelopes" in text_sink.stage(env).error
    assert "delta-aligned" in text_sink.stage(short).error
    assert client.of("put_samples") == []


def test_implementations_satisfy_protocols(text_sink, text_source) -> None:
    from tq_plugin.staging import StagingSource

    assert isinstance(text_sink, StagingSink) and isinstance(text_source, StagingSource)


def test_sink_clear_drops_rows(text_sink, text_source, chain) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])])
    assert text_sink.stage(record).ok
    text_sink.clear(["r/c0"])
    text_sink.clear([])
    with pytest.raises(KeyError):
        text_source.fetch(["r/c0"])


def test_every_put_goes_to_the_staging_partition_with_tags(client, text_sink, chain) -> None:
    (record,) = chain("r", [([1], [2], [-1.0])], weight_versions=[4])
    text_sink.stage(record)
    (put,) = client.of("put_samples")
    assert put["partition_id"] == TEXT_PARTITION and put["sample_ids"] == ["r/c0"]
    assert put["tags"][0]["weight_version"] == 4 and put["tags"][0]["digest"] == record.digest


@pytest.mark.parametrize(
    "bad", [torch.tensor(5), torch.tensor([[1], [2]])], ids=["0-d", "two rows"]
)
def test_store_put_checks_every_leaf_of_the_one_row_batch(client, bad) -> None:
    """The staging store builds its one-row TensorDict unchecked only for plain [1, ...]
    tensors; any other leaf gets the checked constructor, so nothing malformed is sent."""
    from tq_plugin.staging import TQStagingStore

    store = TQStagingStore(client, staging_partition=TEXT_PARTITION)
    with pytest.raises(RuntimeError, match="batch"):
        store.put("r/c0", {"prev_len": torch.tensor([[0]]), "delta_len": bad})
    assert client.of("put_samples") == []
    store.put("r/c0", {"prev_len": torch.nn.Parameter(torch.zeros(1, 1), requires_grad=False)})
    (call,) = client.of("put_samples")
    assert tuple(call["fields"].batch_size) == (1,)
