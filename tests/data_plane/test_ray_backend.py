"""RayDataPlane specifics: one store shared by clients in several processes (the conformance
suite runs every other contract test over it too)."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch

from tq_plugin.data_plane import DataPlaneClosedError, first_write, read_columns

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def store(ray_session):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    owner = RayDataPlane(f"shared-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")
    yield owner
    owner.close()


def test_a_second_client_sees_the_same_rows_and_only_detaches(store):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    store.register_partition("train", [])
    store.put_samples(partition_id="train", sample_ids=["a"], fields={"r": torch.tensor([1.5])})
    other = RayDataPlane(store.store, actor_name="tq_plugin_tests")
    assert not other.is_owner and store.is_owner
    assert other.get_samples(
        partition_id="train", sample_ids=["a"], select_fields=["r"]
    )["r"].tolist() == [1.5]
    other.close()
    with pytest.raises(DataPlaneClosedError):
        other.list_sample_ids("train")
    assert store.list_sample_ids("train") == ["a"]


def test_a_client_shipped_to_a_ray_task_writes_where_the_driver_reads(store, ray_session):
    store.register_partition("train", [])
    assert pickle.loads(pickle.dumps(store)).store == store.store

    @ray_session.remote(num_cpus=0)
    def rollout(client):
        lengths = torch.tensor([3, 1])
        batch = {
            "input_ids": torch.nested.nested_tensor_from_jagged(
                torch.arange(4), torch.tensor([0, 3, 4])
            ),
            "input_lengths": lengths,
            "sample_mask": torch.ones(2),
        }
        return first_write(batch, sample_ids=["x_g0", "x_g1"], client=client, partition_id="train")

    meta = ray_session.get(rollout.remote(store))
    out = read_columns(store, meta, ["input_ids"])
    assert out["input_ids"].tolist() == [[0, 1, 2], [3, 0, 0]]


def test_owner_close_drops_the_store_for_everyone(store):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    other = RayDataPlane(store.store, actor_name="tq_plugin_tests")
    store.close()
    with pytest.raises(DataPlaneClosedError, match="closed"):
        other.list_sample_ids("train")


def test_call_dp_drives_a_raw_actor_handle(ray_session):
    """call_dp's other route: a bare Ray actor handle (``.remote`` methods), errors included."""
    from tq_plugin.data_plane import LocalDataPlane, call_dp

    actor = ray_session.remote(LocalDataPlane).options(num_cpus=0).remote()
    call_dp(actor, "register_partition", partition_id="p", fields=[])
    call_dp(actor, "put_samples", sample_ids=["a"], partition_id="p", fields={"r": torch.ones(1)})
    td = call_dp(actor, "get_samples", sample_ids=["a"], partition_id="p", select_fields=["r"])
    assert td["r"].tolist() == [1.0]
    with pytest.raises(KeyError, match="unknown sample_ids"):
        call_dp(actor, "get_samples", sample_ids=["zz"], partition_id="p", select_fields=["r"])
    ray_session.kill(actor)


def _plasma_objects(ray) -> tuple[int, int]:
    """(MiB, objects) in this cluster's shared-memory object store."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    line = next(x for x in text.splitlines() if "Plasma memory usage" in x)
    words = line.split()
    return int(words[3]), int(words[5])


@pytest.mark.timeout(120)
def test_bulk_bytes_live_in_the_object_store_and_go_back_when_cleared(store, ray_session):
    import time

    store.register_partition("train", [])
    _, objects_before = _plasma_objects(ray_session)
    ids = [f"a{i}" for i in range(8)]
    x = torch.randn(8, 1 << 18)  # 8 MiB: far above the inline threshold
    store.put_samples(partition_id="train", sample_ids=ids, fields={"x": x})
    mib, objects = _plasma_objects(ray_session)
    assert mib >= 8 and objects > objects_before
    assert store.stats()["bytes_held"] == x.numel() * 4
    assert torch.equal(store.get_samples(
        partition_id="train", sample_ids=ids, select_fields=["x"]
    )["x"], x)
    store.clear_samples(partition_id="train", sample_ids=ids)
    assert store.stats()["bytes_held"] == 0
    deadline = time.monotonic() + 30  # Ray frees objects asynchronously
    while _plasma_objects(ray_session)[1] > objects_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _plasma_objects(ray_session)[1] == objects_before


def test_the_actor_runs_only_the_protocol(store):
    with pytest.raises(AttributeError, match="does not run 'close'"):
        store._actor.call.remote(store.store, "close", {}).future().result()
    with pytest.raises(AttributeError, match="does not run '_apply'"):
        store._actor.call.remote(store.store, "_apply", {}).future().result()
    assert store.list_sample_ids("nope") == []


def test_put_options_are_forwarded_by_keyword(store):
    store.register_partition("train", [])
    store.put_samples(
        partition_id="train", sample_ids=["a"], fields={"r": torch.zeros(1)}, mode="insert"
    )
    with pytest.raises(ValueError, match="already exist"):
        store.put_samples(
            partition_id="train", sample_ids=["a"], fields={"r": torch.ones(1)}, mode="insert"
        )
    with pytest.raises(KeyError, match="never written"):
        store.put_samples(
            partition_id="train", sample_ids=["b"], fields={"r": torch.ones(1)}, mode="update"
        )
    assert store.get_samples(
        partition_id="train", sample_ids=["a"], select_fields=["r"]
    )["r"].tolist() == [0.0]


def test_attaching_never_creates_a_store(store):
    from tq_plugin.data_plane.backends.ray_actor import _attach

    with pytest.raises(DataPlaneClosedError, match="does not exist"):
        _attach("no-such-store", "tq_plugin_tests", store.namespace)
    attached = pickle.loads(pickle.dumps(store))
    assert not attached.is_owner and attached.shared


def test_a_dense_column_promoted_to_jagged_keeps_its_rows(store):
    store.register_partition("train", [])
    store.put_samples(
        partition_id="train",
        sample_ids=["a", "b"],
        fields={"tok": torch.tensor([[1, 2, 3], [4, 5, 6]])},
    )
    store.put_samples(partition_id="train", sample_ids=["c"], fields={"tok": torch.tensor([[7]])})
    got = store.get_samples(
        partition_id="train", sample_ids=["c", "a", "b"], select_fields=["tok"]
    )["tok"]
    assert [r.tolist() for r in got.unbind()] == [[7], [1, 2, 3], [4, 5, 6]]


def test_claims_see_lengths_stored_in_the_object_store(store):
    store.register_partition("train", [], consumer_tasks=["actor"])
    n = 9000  # int64 lengths: 72 KB, above the inline threshold
    ids = [f"s{i}" for i in range(n)]
    store.put_samples(
        partition_id="train", sample_ids=ids, fields={"input_lengths": torch.arange(n)}
    )
    meta = store.claim_meta("train", "actor", ["input_lengths"], batch_size=4)
    assert meta.sample_ids == ids[:4] and meta.sequence_lengths == [0, 1, 2, 3]
    td = store.get_data(meta)
    assert td["input_lengths"].tolist() == [0, 1, 2, 3]
    assert not store.check_consumption_status("train", ["actor"])


def test_attaching_to_a_running_cluster_ignores_the_start_up_resources(store, ray_session):
    """The shipped config's ray_init (num_cpus, dashboard) is for starting Ray; a process that
    attaches with tq.backend.address must not pass it on (Ray refuses num_cpus from a joiner)."""
    import subprocess
    import sys

    address = ray_session.get_runtime_context().gcs_address
    store.register_partition("p", [])
    store.put_samples(partition_id="p", sample_ids=["a"], fields={"r": torch.tensor([2.5])})
    code = (
        "from tq_plugin.data_plane.backends.ray_actor import RayDataPlane\n"
        f"c = RayDataPlane({store.store!r}, actor_name='tq_plugin_tests', address={address!r},\n"
        "                 ray_init={'num_cpus': 2, 'include_dashboard': False})\n"
        "print(c.get_samples(['a'], 'p', ['r'])['r'].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[2.5]" in out.stdout
