"""Fault injection: a client failing at the put, or mid-way through it, leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from tq_plugin.staging import StagedCallBaseSnapshot, TQTokenSink, TQTokenSource

TEXT_PARTITION = "rollout_staging"
MEDIA_PARTITION = "media_staging"


@pytest.mark.parametrize("midway", [False, True], ids=["fails-at-put", "fails-mid-write"])
@pytest.mark.parametrize("partition", [TEXT_PARTITION, MEDIA_PARTITION])
def test_failed_write_reports_and_leaves_nothing_behind(
    client, chain, media, midway, partition
) -> None:
    is_media = partition == MEDIA_PARTITION
    sink = TQTokenSink(
        client,
        staging_partition=partition,
        capture_media=is_media,
        media_pixel_dtype=torch.bfloat16 if is_media else None,
    )
    source = TQTokenSource(
        client,
        staging_partition=partition,
        capture_media=is_media,
        snapshot_cls=StagedCallBaseSnapshot,
    )
    (kept,) = chain("kept", [([1], [2], [-0.5])])
    assert sink.stage(kept).ok
    (lost,) = chain("lost", [([1], [2], [-0.5])])
    client.fail_put, client.midway = ConnectionError("storage unit vanished"), midway
    result = sink.stage(lost, attachments=media.still() if is_media else None)
    assert (
        not result.ok
        and result.staging_key == "lost/c0"
        and "storage unit vanished" in result.error
    )
    assert client.inner.list_sample_ids(partition_id=partition) == ["kept/c0"]
    with pytest.raises(KeyError):
        source.fetch(["lost/c0"])
    with pytest.raises(KeyError):
        source.fetch_prefix_token_ids(["lost/c0"])

    client.fail_put = None
    assert sink.stage(lost).ok  # a retry after the fault lands cleanly
    assert [s.staging_key for s in source.fetch(["lost/c0", "kept/c0"])] == ["lost/c0", "kept/c0"]


def test_a_failing_read_is_a_keyerror(client, text_sink, text_source, chain) -> None:
    (record,) = chain("r", [([1], [2], [-0.5])])
    assert text_sink.stage(record).ok

    def broken(**kwargs):
        raise TimeoutError("controller unreachable")

    client.get_samples = broken
    with pytest.raises(KeyError, match="controller unreachable"):
        text_source.fetch(["r/c0"])
