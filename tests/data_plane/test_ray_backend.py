"""RayDataPlane specifics: one store shared by clients in several processes (the conformance
suite runs every other contract test over it too)."""

from __future__ import annotations

import pickle
import uuid

import pytest
import torch

from tq_plugin.data_plane import DataPlaneClosedError, first_write, read_columns

pytestmark = pytest.mark.slow


@pytest.fixture
def store(ray_session):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    owner = RayDataPlane(f"shared-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")
    yield owner
    owner.close()


def test_a_second_client_sees_the_same_rows_and_only_detaches(store):
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    store.register_partition("train", [])
    store.put_samples(["a"], "train", {"r": torch.tensor([1.5])})
    other = RayDataPlane(store.store, actor_name="tq_plugin_tests")
    assert not other.is_owner and store.is_owner
    assert other.get_samples(["a"], "train", ["r"])["r"].tolist() == [1.5]
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
