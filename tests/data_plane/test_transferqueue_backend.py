"""TransferQueueDataPlane specifics: the guards TransferQueue 0.1.11 lacks, start-up checks that
keep it from hanging, loopback-only binding, and attach from another Ray process (the
conformance suite runs every other contract test over it too)."""

from __future__ import annotations

import pickle
import threading
import uuid

import pytest
import torch

from tq_plugin.data_plane import DataPlaneClosedError

from .conftest import ragged, rows_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def tq(tq_session):
    from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

    c = TransferQueueDataPlane(f"tq-{uuid.uuid4().hex[:8]}")
    c.register_partition("train", [])
    yield c
    c.close()


def test_a_dtype_change_is_refused_before_transferqueue_sees_it(tq):
    # TransferQueue itself accepts this put and later casts mixed reads (reference §5.1).
    tq.put_samples(
        partition_id="train", sample_ids=["a"], fields={"lp": ragged([3], torch.float32)}
    )
    with pytest.raises(TypeError, match="'lp' dtype mismatch"):
        tq.put_samples(
            partition_id="train", sample_ids=["b"], fields={"lp": ragged([2], torch.float64)}
        )
    assert tq.list_sample_ids("train") == ["a"]


def test_short_reads_and_missing_fields_raise_instead_of_shrinking(tq):
    # TransferQueue drops missing keys and answers a missing field with an empty batch (§5.2-3).
    tq.put_samples(partition_id="train", sample_ids=["a", "b"], fields={"r": torch.zeros(2)})
    tq.put_samples(partition_id="train", sample_ids=["a"], fields={"adv": torch.ones(1)})
    with pytest.raises(KeyError, match=r"1 unknown sample_ids.*'zz'"):
        tq.get_samples(partition_id="train", sample_ids=["a", "zz"], select_fields=["r"])
    with pytest.raises(KeyError, match=r"'adv' not written for 1 requested rows.*'b'"):
        tq.get_samples(partition_id="train", sample_ids=["a", "b"], select_fields=["adv", "r"])


def test_dense_fields_of_any_rank_come_back_dense(tq):
    img = torch.arange(2 * 3 * 4, dtype=torch.int32).reshape(2, 3, 4)
    tq.put_samples(
        partition_id="train", sample_ids=["a", "b"], fields={"img": img, "tok": ragged([4, 1])}
    )
    td = tq.get_samples(partition_id="train", sample_ids=["b", "a"], select_fields=["img", "tok"])
    assert not td["img"].is_nested and torch.equal(td["img"], img.flip(0))
    assert td["tok"].layout == torch.jagged and [r.shape[0] for r in rows_of(td["tok"])] == [1, 4]


def test_put_modes_insert_and_update(tq):
    tq.put_samples(
        partition_id="train", sample_ids=["a"], fields={"r": torch.zeros(1)}, mode="insert"
    )
    with pytest.raises(ValueError, match=r"already exist.*'a'"):
        tq.put_samples(
            partition_id="train", sample_ids=["a"], fields={"r": torch.ones(1)}, mode="insert"
        )
    with pytest.raises(KeyError, match=r"never written.*'b'"):
        tq.put_samples(
            partition_id="train", sample_ids=["a", "b"], fields={"r": torch.ones(2)}, mode="update"
        )
    tq.put_samples(
        partition_id="train", sample_ids=["a"], fields={"r": torch.ones(1)}, mode="update"
    )
    assert tq.get_samples(
        partition_id="train", sample_ids=["a"], select_fields=["r"]
    )["r"].tolist() == [1.0]


def test_claims_hand_each_row_to_a_task_once(tq):
    tq.register_partition("roll", [], consumer_tasks=["trainer"])
    ids = [f"s{i}" for i in range(4)]
    tq.put_samples(
        partition_id="roll",
        sample_ids=ids,
        fields={"input_ids": ragged([3, 1, 2, 5]), "input_lengths": torch.tensor([3, 1, 2, 5])},
    )
    first = tq.claim_meta("roll", "trainer", ["input_ids"], batch_size=2)
    second = tq.claim_meta("roll", "trainer", ["input_ids"], batch_size=2)
    assert sorted(first.sample_ids + second.sample_ids) == ids
    assert first.sequence_lengths == [[3, 1, 2, 5][int(s[1:])] for s in first.sample_ids]
    assert tq.claim_meta("roll", "trainer", ["input_ids"], batch_size=2, blocking=False).sample_ids == []
    assert tq.check_consumption_status("roll", ["trainer"])
    got = tq.get_data(first)["input_ids"]
    assert [r.shape[0] for r in rows_of(got)] == first.sequence_lengths


def test_a_client_shipped_to_a_ray_task_writes_where_the_driver_reads(tq, tq_session):
    attached = pickle.loads(pickle.dumps(tq))
    assert attached.store == tq.store and not attached.is_owner and attached.shared

    @tq_session.remote(num_cpus=0)
    def write(client):
        client.put_samples(
            partition_id="train",
            sample_ids=["x", "y"],
            fields={"tok": ragged([3, 2], torch.int64, seed=4)},
        )
        return client.list_sample_ids("train")

    assert tq_session.get(write.remote(tq), timeout=120) == ["x", "y"]
    got = tq.get_samples(partition_id="train", sample_ids=["y", "x"], select_fields=["tok"])["tok"]
    want = rows_of(ragged([3, 2], torch.int64, seed=4))
    assert torch.equal(rows_of(got)[0], want[1]) and torch.equal(rows_of(got)[1], want[0])
    attached.close()  # detaches only
    assert tq.list_sample_ids("train") == ["x", "y"]
    with pytest.raises(DataPlaneClosedError):
        attached.list_sample_ids("train")


def test_stores_do_not_see_each_other(tq, tq_session):
    from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

    other = TransferQueueDataPlane(f"tq-{uuid.uuid4().hex[:8]}")
    try:
        tq.put_samples(partition_id="train", sample_ids=["a"], fields={"r": torch.zeros(1)})
        assert other.list_sample_ids("train") == []
        with pytest.raises(KeyError, match="unknown partition"):
            other.put_samples(partition_id="train", sample_ids=["a"], fields={"r": torch.zeros(1)})
    finally:
        other.close()


# ---------------------------------------------------------------- start-up and binding guards
def test_start_up_refuses_without_the_cpus_transferqueue_would_wait_for(monkeypatch, ray_session):
    from tq_plugin.data_plane.backends import transferqueue as mod

    def no_controller(*_a, **_k):
        raise ValueError("no such actor")

    monkeypatch.setattr(ray_session, "get_actor", no_controller)
    monkeypatch.setattr(ray_session, "available_resources", lambda: {"CPU": 1.0})
    with pytest.raises(RuntimeError, match=r"needs 3 Ray CPUs \(1 controller \+ 2 storage units.*1 available"):
        mod.ensure_transfer_queue(num_storage_units=2)


def test_a_blocking_call_past_its_deadline_raises():
    from tq_plugin.data_plane.backends.transferqueue_service import with_deadline

    gate = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="kv_batch_get did not answer within 0.2s"):
            with_deadline("kv_batch_get", 0.2, gate.wait, timeout=30)
    finally:
        gate.set()


def test_a_tags_only_put_creates_rows_and_tags_merge(tq):
    tq.put_samples(partition_id="train", sample_ids=["n"], tags=[{"x": 1}])
    tq.put_samples(
        partition_id="train", sample_ids=["n"], fields={"r": torch.zeros(1)}, tags=[{"y": 2}]
    )
    assert tq.list_sample_ids("train") == ["n"]
    assert tq.get_tags(partition_id="train", sample_ids=["n"]) == [{"x": 1, "y": 2}]
    with pytest.raises(ValueError, match="reserved"):
        tq.put_samples(
            partition_id="train", sample_ids=["__tq_plugin_schema__"], fields={"r": torch.zeros(1)}
        )


def test_a_claimed_row_always_has_its_tags(tq):
    """TransferQueue 0.1.11 marks a put's fields ready before it sets the put's tags; the
    adapter sets the tags first, so a claim racing the put never hands out a row without them
    (the disaggregated trainer reads each chunk's ticket from the tags of the rows it claims)."""
    rounds, claimed, errors = 60, [], []

    def produce():
        try:
            for i in range(rounds):
                tq.put_samples(
                    partition_id="train",
                    sample_ids=[f"r{i}"],
                    fields={"v": torch.tensor([i])},
                    tags=[{"ticket": i}],
                )
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    writer = threading.Thread(target=produce)
    writer.start()
    while len(claimed) < rounds and not errors:
        meta = tq.claim_meta("train", "consume", ["v"], batch_size=1, blocking=True, timeout_s=30)
        claimed += [(sid, dict(tag)) for sid, tag in zip(meta.sample_ids, meta.tags, strict=True)]
    writer.join()
    assert not errors
    assert [tag.get("ticket") for _, tag in claimed] == [int(sid[1:]) for sid, _ in claimed]


def test_an_emptied_partition_takes_a_field_of_another_dtype(tq, tq_session):
    """As LocalDataPlane: once no row holds a field it may change dtype. The put decides (the
    clear that empties a partition no longer rewrites its schema, which raced other clients'
    puts: their rows landed under a schema without their fields)."""
    from tq_plugin.data_plane.backends.transferqueue import TransferQueueDataPlane

    tq.put_samples(
        partition_id="train", sample_ids=["a"], fields={"lp": ragged([3], torch.float32)}
    )
    tq.clear_samples(partition_id="train", sample_ids=["a"])
    tq.put_samples(
        partition_id="train", sample_ids=["b"], fields={"lp": ragged([2], torch.float64)}
    )  # empty: may change
    assert tq.get_samples(
        partition_id="train", sample_ids=["b"], select_fields=["lp"]
    )["lp"].dtype == torch.float64
    other = TransferQueueDataPlane(tq.store, _owner=False)  # another process's client
    other.put_samples(
        partition_id="train", sample_ids=["c"], fields={"lp": ragged([1], torch.float64)}
    )
    tq.clear_samples(partition_id="train", sample_ids=["b"])  # leaves "c": its field stays readable
    assert tq.get_samples(
        partition_id="train", sample_ids=["c"], select_fields=["lp"]
    )["lp"].dtype == torch.float64
    other.clear_samples(partition_id="train", sample_ids=["c"])
    with pytest.raises(KeyError):
        tq.get_samples(partition_id="train", sample_ids=["c"], select_fields=["lp"])
