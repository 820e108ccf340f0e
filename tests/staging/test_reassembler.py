"""RolloutReassembler.finalize_group: verified rows, placeholders for bad rollouts, one put."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.staging import (
    STATUS_TAG,
    RolloutReassembler,
    make_rollout_receipt,
)
from tq_plugin.staging.reassembler import REASSEMBLED_FIELDS, REASSEMBLED_MEDIA_FIELDS

TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"

TRAIN = "train"


@pytest.fixture
def train_partition(client):
    client.inner.register_partition(
        partition_id=TRAIN, fields=[*REASSEMBLED_FIELDS, *REASSEMBLED_MEDIA_FIELDS]
    )
    return TRAIN


def _read(client, meta, fields):
    return client.inner.get_samples(
        sample_ids=meta.sample_ids, partition_id=TRAIN, select_fields=fields
    )


def _stage_rollout(sink, chain, rollout_id, reward=1.0, **kwargs):
    records = chain(rollout_id, [([1, 2], [3], [-0.5]), ([4], [5, 6], [-0.25, -0.125])], **kwargs)
    for record in records:
        assert sink.stage(record).ok
    return records, make_rollout_receipt(records, reward=reward)


def test_a_clean_group_becomes_verified_training_rows(
    client, text_sink, chain, train_partition
) -> None:
    receipts = [_stage_rollout(text_sink, chain, f"r{i}", reward=float(i))[1] for i in range(3)]
    client.calls.clear()
    reassembler = RolloutReassembler(client, staging_partition=TEXT_PARTITION)
    meta = reassembler.finalize_group(receipts, partition_id=TRAIN)
    assert len(client.of("get_samples")) == 1 and len(client.of("put_samples")) == 1
    assert meta.sample_ids == ["r0", "r1", "r2"] and meta.sequence_lengths == [6, 6, 6]
    td = _read(client, meta, list(REASSEMBLED_FIELDS))
    assert td["input_ids"][1].tolist() == [1, 2, 3, 4, 5, 6]
    assert td["token_mask"][1].tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert td["generation_logprobs"][1].tolist() == [0.0, 0.0, -0.5, 0.0, -0.25, -0.125]
    assert td["sample_mask"].tolist() == [1.0, 1.0, 1.0] and td["total_reward"].tolist() == [
        0.0,
        1.0,
        2.0,
    ]
    assert [t[STATUS_TAG] for t in meta.tags] == ["ok"] * 3


def test_bad_rollouts_become_placeholders_never_skips_or_crashes(
    client, text_sink, chain, train_partition
) -> None:
    _, good = _stage_rollout(text_sink, chain, "good")
    _, poisoned = _stage_rollout(text_sink, chain, "poisoned")
    poisoned = poisoned.model_copy(update={"capture_poisoned": True})
    _, missing = _stage_rollout(text_sink, chain, "missing")
    text_sink.clear(["missing/c1"])
    _, corrupt = _stage_rollout(text_sink, chain, "corrupt")
    client.inner.put_samples(
        sample_ids=["corrupt/c0"],
        partition_id=TEXT_PARTITION,
        fields={"token_ids_delta": torch.tensor([[1, 2, 9]])},
    )
    _, lying = _stage_rollout(text_sink, chain, "lying")
    rows = list(lying.manifest)
    rows[1] = rows[1].model_copy(update={"weight_version": 7})
    lying = lying.model_copy(update={"manifest": rows})

    reassembler = RolloutReassembler(client, staging_partition=TEXT_PARTITION, pad_token_id=0)
    meta = reassembler.finalize_group(
        [good, poisoned, missing, corrupt, lying, "garbage"], partition_id=TRAIN
    )
    statuses = [t[STATUS_TAG] for t in meta.tags]
    assert statuses == [
        "ok",
        "capture_poisoned",
        "fetch_failed",
        "fetch_failed",
        "wrong_weight_version",
        "invalid_receipt",
    ]
    td = _read(client, meta, ["sample_mask", "input_ids", "input_lengths", "total_reward"])
    assert td["sample_mask"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert td["input_lengths"].tolist() == [6, 1, 1, 1, 1, 1]
    assert td["input_ids"][1].tolist() == [0] and td["total_reward"].tolist()[1:] == [0.0] * 5


def test_clear_staged_drops_the_groups_staging_rows(
    client, text_sink, text_source, chain, train_partition
) -> None:
    records, receipt = _stage_rollout(text_sink, chain, "r")
    RolloutReassembler(client, staging_partition=TEXT_PARTITION, clear_staged=True).finalize_group(
        [receipt], partition_id=TRAIN, sample_ids=["s0"]
    )
    with pytest.raises(KeyError):
        text_source.fetch([records[0].staging_key])


def test_media_along_the_chain_lands_in_the_training_row(
    client, media_sink, chain, media, train_partition
) -> None:
    records = chain("m", [([1, 2], [3], [-0.5]), ([4], [5], [-0.5]), ([6], [7], [-0.5])])
    bundles = [media.still(frames=1), None, media.video(frames=2)]
    for record, bundle in zip(records, bundles):
        assert media_sink.stage(record, attachments=bundle).ok
    text_records = chain("t", [([1], [2], [-0.5])])
    assert media_sink.stage(text_records[0]).ok
    receipts = [make_rollout_receipt(records), make_rollout_receipt(text_records)]
    meta = RolloutReassembler(
        client, staging_partition=MEDIA_PARTITION, capture_media=True
    ).finalize_group(receipts, partition_id=TRAIN)
    assert [t[STATUS_TAG] for t in meta.tags] == ["ok", "ok"]
    td = _read(client, meta, list(REASSEMBLED_MEDIA_FIELDS))
    want = torch.cat([bundles[0]["imgs"][0], bundles[2]["imgs"][0]])
    assert torch.equal(td["media_imgs"][0], want)
    assert td["media_imgs_sizes"][0].tolist() == [[4, 4], [4, 4], [4, 4]]
    assert td["media_num_frames"][0].tolist() == [1, 2]
    assert td["media_imgs"][1].shape[0] == 0


def test_repeated_sample_ids_are_refused_before_any_read(client, text_sink, chain, train_partition):
    _, receipt = _stage_rollout(text_sink, chain, "r")
    client.calls.clear()
    reassembler = RolloutReassembler(client, staging_partition=TEXT_PARTITION)
    with pytest.raises(ValueError, match="unique sample ids"):
        reassembler.finalize_group([receipt, receipt], partition_id=TRAIN)
    assert client.calls == []
    meta = reassembler.finalize_group([receipt, receipt], partition_id=TRAIN, sample_ids=["a", "b"])
    assert [t[STATUS_TAG] for t in meta.tags] == ["ok", "ok"]


def test_the_reward_column_is_optional(client, text_sink, chain) -> None:
    client.inner.register_partition(
        partition_id="lean", fields=[f for f in REASSEMBLED_FIELDS if f != "total_reward"]
    )
    _, receipt = _stage_rollout(text_sink, chain, "r")
    reassembler = RolloutReassembler(client, staging_partition=TEXT_PARTITION, reward_field=None)
    meta = reassembler.finalize_group([receipt], partition_id="lean")
    assert "total_reward" not in meta.fields
