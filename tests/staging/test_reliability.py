"""Reliability regressions (issue #8, token staging; issue #9, the put payload type).

Each test pins one finding: a failed re-stage never deletes an acknowledged row, staging keys
are injective, a retried ``finalize_group`` converges, ``stage`` never raises and names the
offending field, and a client written to the TensorDict ``put_samples`` contract works.
"""

from __future__ import annotations

import pytest
from tensordict import TensorDictBase

from tq_plugin.data_plane import ROUTED_EXPERTS_FIELD, CapacityError, LocalDataPlane
from tq_plugin.staging import (
    STAGING_FIELDS,
    STATUS_TAG,
    CaptureAdmission,
    ChainPrefixCache,
    ReceiptVerificationError,
    RolloutReassembler,
    StagedCallBaseSnapshot,
    TQTokenSink,
    TQTokenSource,
    make_rollout_receipt,
    make_staged_call_record,
    register_staging_partition,
    resolve_admission_prefix,
    staging_key,
    verify_and_linearize,
)
from tq_plugin.staging.reassembler import REASSEMBLED_FIELDS, FinalizeRetryError

TEXT_PARTITION = "rollout_staging"
TRAIN = "train"


def _one(chain, rollout_id, generated=(2,), call_id="c0"):
    (record,) = chain(
        rollout_id, [([1], list(generated), [-0.5] * len(generated))], call_ids=[call_id]
    )
    return record


def _live(client, partition=TEXT_PARTITION):
    return client.inner.list_sample_ids(partition_id=partition)


# ---------------------------------------------------------------- 4: re-stage keeps the ack
@pytest.mark.parametrize("fault", ["store-rejection", "connection-error"])
def test_a_failed_restage_never_deletes_the_acknowledged_row(
    client, text_sink, text_source, chain, fault
) -> None:
    acked = _one(chain, "r")
    assert text_sink.stage(acked).ok
    different = _one(chain, "r", generated=(7, 8))  # same key, other bytes
    client.fail_put = (
        ValueError("store rejected the put")
        if fault == "store-rejection"
        else ConnectionError("reset before anything was written")
    )
    result = text_sink.stage(different)
    assert not result.ok and result.staging_key == "r/c0"
    assert "already holds a different acknowledged call" in result.error
    (snapshot,) = text_source.fetch(["r/c0"])
    assert snapshot.digest == acked.digest  # the acknowledged row stands, and verifies
    assert client.of("clear_samples") == []


def test_a_restage_of_the_same_call_that_raises_is_still_durable(
    client, text_sink, text_source, chain
) -> None:
    acked = _one(chain, "r")
    assert text_sink.stage(acked).ok
    client.fail_put = ConnectionError("reset before anything was written")
    result = text_sink.stage(acked)  # an idempotent retry: the row already holds this call
    assert result.ok and result.staging_key == "r/c0"
    assert text_source.fetch(["r/c0"])[0].digest == acked.digest


def test_a_put_that_lands_and_then_raises_is_acknowledged(client, text_source, chain) -> None:
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    record = _one(chain, "r")

    def landed_then_lost(**kwargs):
        client.inner.put_samples(**kwargs)
        raise TimeoutError("reply lost")

    client.put_samples = landed_then_lost
    result = sink.stage(record)
    assert result.ok and text_source.fetch(["r/c0"])[0].digest == record.digest


def test_an_unreadable_failed_write_is_kept_and_a_retry_settles_it(
    client, text_sink, text_source, chain
) -> None:
    record = _one(chain, "r")
    client.fail_put, client.midway = ConnectionError("cut mid-write"), True
    client.get_samples = lambda **kwargs: (_ for _ in ()).throw(TimeoutError("no reply"))
    assert not text_sink.stage(record).ok
    assert client.of("clear_samples") == []  # state unknown: nothing discarded
    del client.get_samples
    client.fail_put = None
    assert text_sink.stage(record).ok  # the retry overwrites the partial row
    assert text_source.fetch(["r/c0"])[0].digest == record.digest


# ---------------------------------------------------------------- 5: injective staging keys
def test_staging_keys_are_injective(client, text_sink, text_source, chain) -> None:
    first = _one(chain, "a/b", call_id="c")
    second = _one(chain, "a", generated=(5,), call_id="b/c")
    keys = [text_sink.stage(r).staging_key for r in (first, second)]
    assert len(set(keys)) == 2 and sorted(_live(client)) == sorted(keys)
    got = text_source.fetch(keys)
    assert [(s.rollout_id, s.model_call_id) for s in got] == [("a/b", "c"), ("a", "b/c")]
    assert staging_key("a%2Fb", "c") != staging_key("a/b", "c")
    assert staging_key("rollout-1", "call-1") == "rollout-1/call-1"  # plain ids: reference form


# ---------------------------------------------------------------- 6: finalize is idempotent
class _ClearThenRaise:
    """Wraps a client: ``clear_samples`` clears, then raises (the reply was lost)."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def clear_samples(self, **kwargs):
        self.inner.clear_samples(**kwargs)
        if self.armed:
            self.armed = False
            raise ConnectionError("clear applied, reply lost")


def _staged_group(client, chain, calls_per_rollout) -> list:
    """The receipts of rollouts ``r0, r1, ...`` staged whole (one list of calls each), with the
    train partition registered."""
    client.inner.register_partition(partition_id=TRAIN, fields=list(REASSEMBLED_FIELDS))
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    receipts = []
    for i, calls in enumerate(calls_per_rollout):
        records = chain(f"r{i}", calls)
        assert all(sink.stage(r).ok for r in records)
        receipts.append(make_rollout_receipt(records, reward=float(i)))
    return receipts


def test_a_retried_finalize_after_the_clear_raised_keeps_every_rollout(client, chain) -> None:
    receipts = _staged_group(client, chain, [[([1, 2], [3], [-0.5]), ([4], [5 + i], [-0.25])]
                                             for i in range(3)])
    flaky = _ClearThenRaise(client)
    reassembler = RolloutReassembler(flaky, staging_partition=TEXT_PARTITION, clear_staged=True)
    with pytest.raises(ConnectionError):
        reassembler.finalize_group(receipts, partition_id=TRAIN)
    meta = reassembler.finalize_group(receipts, partition_id=TRAIN)
    assert [t[STATUS_TAG] for t in meta.tags] == ["ok"] * 3
    assert meta.sequence_lengths == [5, 5, 5] and set(meta.fields) == set(REASSEMBLED_FIELDS)
    td = client.inner.get_samples(
        sample_ids=meta.sample_ids, partition_id=TRAIN, select_fields=["sample_mask", "input_ids"]
    )
    assert td["sample_mask"].tolist() == [1.0] * 3
    assert td["input_ids"][2].tolist() == [1, 2, 3, 4, 7]
    assert _live(client) == []


def test_a_retry_after_the_rows_were_consumed_raises_and_writes_no_placeholder(
    client, chain
) -> None:
    """The first attempt's write and clear landed, its reply did not; by the time it is
    retried the trainer has consumed the rows and cleared them. The retry cannot return them
    (nor re-read the staged calls the first attempt cleared): it raises, and writes nothing."""
    receipts = _staged_group(client, chain, [[([1, 2], [3], [-0.5])]] * 2)
    flaky = _ClearThenRaise(client)
    reassembler = RolloutReassembler(flaky, staging_partition=TEXT_PARTITION, clear_staged=True)
    with pytest.raises(ConnectionError):
        reassembler.finalize_group(receipts, partition_id=TRAIN)
    written = _live(client, TRAIN)
    assert len(written) == 2
    client.inner.clear_samples(sample_ids=written, partition_id=TRAIN)  # consumed
    with pytest.raises(FinalizeRetryError, match="finalized into partition 'train' already"):
        reassembler.finalize_group(receipts, partition_id=TRAIN)
    assert _live(client, TRAIN) == []  # no placeholder rows
    assert _live(client) == []


def test_a_transport_failure_on_the_staged_read_raises_instead_of_placeholders(
    client, chain
) -> None:
    client.inner.register_partition(partition_id=TRAIN, fields=list(REASSEMBLED_FIELDS))
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    records = chain("r", [([1], [2], [-0.5])])
    assert sink.stage(records[0]).ok
    client.get_samples = lambda **kwargs: (_ for _ in ()).throw(ConnectionError("down"))
    reassembler = RolloutReassembler(client, staging_partition=TEXT_PARTITION)
    with pytest.raises(KeyError, match="down"):
        reassembler.finalize_group([make_rollout_receipt(records)], partition_id=TRAIN)
    assert _live(client, TRAIN) == []  # nothing written: a retry finalizes it for real


# ---------------------------------------------------------------- 7, 8: stage never raises
def test_a_lone_surrogate_id_is_a_failed_stage_naming_the_field(client, text_sink, chain) -> None:
    record = _one(chain, "r").model_copy(update={"rollout_id": "r\ud800"})
    result = text_sink.stage(record)
    assert not result.ok and result.staging_key is None
    assert "rollout_id" in result.error and "surrogate" in result.error
    assert _live(client) == [] and client.of("put_samples") == []


def test_float_token_ids_are_a_failed_stage_naming_the_field(client, text_sink, chain) -> None:
    record = _one(chain, "r").model_copy(update={"token_ids_delta": [1.0, 2.0]})
    result = text_sink.stage(record)
    assert not result.ok and "token_ids_delta" in result.error and "1.0" in result.error
    assert _live(client) == [] and client.of("put_samples") == []


# ---------------------------------------------------------------- 9: TensorDict payloads
class _ContractClient:
    """A client written to the reference contract: ``fields`` is a TensorDict of batch [N]."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_samples(self, sample_ids, partition_id, fields=None, tags=None):
        assert isinstance(fields, TensorDictBase) and fields.batch_size == (len(sample_ids),)
        wanted = fields.select(*fields.keys())
        return self.inner.put_samples(
            sample_ids=sample_ids, partition_id=partition_id, fields=wanted, tags=tags
        )


def test_a_client_written_to_the_tensordict_contract_works_under_the_sink(chain) -> None:
    inner = LocalDataPlane()
    register_staging_partition(inner, TEXT_PARTITION)
    client = _ContractClient(inner)
    sink = TQTokenSink(client, staging_partition=TEXT_PARTITION)
    record = _one(chain, "r")
    result = sink.stage(record)
    assert result.ok, result.error
    source = TQTokenSource(
        client, staging_partition=TEXT_PARTITION, snapshot_cls=StagedCallBaseSnapshot
    )
    assert source.fetch(["r/c0"])[0].digest == record.digest


def test_a_partition_registered_by_field_names_alone_stages_and_finalizes(chain) -> None:
    store = LocalDataPlane()
    store.register_partition(
        partition_id=TEXT_PARTITION,
        fields=[*STAGING_FIELDS, ROUTED_EXPERTS_FIELD],
        consumer_tasks=["finalize"],
    )
    store.register_partition(partition_id=TRAIN, fields=list(REASSEMBLED_FIELDS))
    sink = TQTokenSink(store, staging_partition=TEXT_PARTITION)
    source = TQTokenSource(
        store, staging_partition=TEXT_PARTITION, snapshot_cls=StagedCallBaseSnapshot
    )
    receipts, staged = [], []
    for i in range(3):
        turns = [([1, 2][: i + 1], [3] * (i + 1), [-0.5] * (i + 1)), ([4], [5, 6], [-0.25] * 2)]
        records = chain(f"r-{i}", turns)
        for record in records:
            result = sink.stage(record)
            assert result.ok, result.error
        staged += records
        receipts.append(make_rollout_receipt(records, reward=1.0))
    assert [s.digest for s in source.fetch([r.staging_key for r in staged])] == [
        r.digest for r in staged
    ]
    assert source.fetch_prefix_token_ids(["r-2/c0"]) == [1, 2, 3, 3, 3]
    # The worker's capture path: a child admitted by staging_chain resolves its prefix from
    # the partition, and its record stages there too.
    parent = staged[-1]
    admission = CaptureAdmission(
        rollout_id="r-2",
        model_call_id="c2",
        parent_call_id=parent.model_call_id,
        prev_len=parent.cum_len,
        mode="token_in",
        staging_chain=["r-2/c0", "r-2/c1"],
        parent_chain_hash=parent.chain_hash,
    )
    prefix = resolve_admission_prefix(admission, ChainPrefixCache(source))
    child = make_staged_call_record(
        admission,
        prompt_ids=[*prefix, 7],
        generated_ids=[8, 9, 10],
        generated_logprobs=[-0.5] * 3,
        weight_version=1,
        prefix_token_ids=prefix,
    )
    assert sink.stage(child).ok
    receipts[2] = make_rollout_receipt([*staged[-2:], child], reward=1.0)
    meta = RolloutReassembler(store, staging_partition=TEXT_PARTITION).finalize_group(
        receipts, partition_id=TRAIN
    )
    assert [t[STATUS_TAG] for t in meta.tags] == ["ok"] * 3


def test_a_full_store_is_a_failed_stage_and_the_acknowledged_rows_stand(chain) -> None:
    store = LocalDataPlane()
    register_staging_partition(store, TEXT_PARTITION, num_samples=1)
    sink = TQTokenSink(store, staging_partition=TEXT_PARTITION)
    first, second = _one(chain, "a"), _one(chain, "b")
    assert sink.stage(first).ok
    with pytest.raises(CapacityError):  # what the sink meets
        store.put_samples(sample_ids=["x"], partition_id=TEXT_PARTITION, fields=None)
    result = sink.stage(second)
    assert not result.ok and "CapacityError" in result.error
    assert store.list_sample_ids(partition_id=TEXT_PARTITION) == ["a/c0"]
    source = TQTokenSource(store, staging_partition=TEXT_PARTITION)
    assert source.fetch(["a/c0"])[0].digest == first.digest


def test_a_tampered_snapshot_column_fails_verification_naming_the_field(chain) -> None:
    records = chain("r", [([1, 2], [3], [-0.5])])
    snapshot = (
        records[0].to_base_snapshot().model_copy(update={"token_mask_delta": [0.0, "x", 1.0]})
    )
    with pytest.raises(ReceiptVerificationError, match="token_mask_delta"):
        verify_and_linearize(make_rollout_receipt(records), [snapshot])
