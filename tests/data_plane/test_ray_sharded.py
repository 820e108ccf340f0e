"""The Ray store sharded (``RayDataPlane(num_storage_units=S)``, ``backends/ray_sharded.py``).

Its contract is the single store's: the conformance suite and the state machine run on it
(``ray_sharded``, every block staged on a unit). Here: which blocks go to a unit and which unit,
the stand-in the controller validates in place of the bytes, and (slow, Ray) that a put's bytes
are owned by the unit its first sample id hashes to while reads, claims and pickled clients
work across units.
"""

from __future__ import annotations

import gc
import pickle
import uuid
import zlib

import numpy as np
import pytest
import torch

from tq_plugin.data_plane import nested_from_lengths
from tq_plugin.data_plane.backends import ray_columns
from tq_plugin.data_plane.backends.ray_columns import (
    StagedBlock,
    decode_fields,
    encode_fields,
    stage_block,
)
from tq_plugin.data_plane.backends.ray_sharded import checked_units, shipped, unit_of


def _items(fields):
    return encode_fields(fields)[2]


def test_only_large_blocks_a_unit_can_take_whole_are_shipped():
    lengths = torch.tensor([3, 5])
    fields = {
        "input_ids": nested_from_lengths(torch.arange(8), lengths),  # 64 bytes
        "input_lengths": lengths,  # read by the controller: always inline
        "reward": torch.ones(2),  # 8 bytes
        "one": torch.ones(1),  # one element: inline
        "img": torch.zeros(2, 64, dtype=torch.uint8),  # 128 bytes
    }
    items = _items(fields)
    names = [i[0] for i in items]
    assert [names[i] for i in shipped(items, 0)] == ["input_ids", "reward", "img"]
    assert [names[i] for i in shipped(items, 64)] == ["input_ids", "img"]
    assert [names[i] for i in shipped(items, 100)] == ["img"]
    # A jagged block whose offsets skip values travels inline (its error names what was sent).
    skewed = [("x", "jagged", "int64", np.arange(10), np.array([2, 5, 10]))]
    short = [("x", "jagged", "int64", np.arange(10), np.array([0, 5, 9]))]
    assert shipped(skewed, 0) == [] and shipped(short, 0) == []


def test_a_sample_id_hashes_to_one_unit_the_same_everywhere():
    assert unit_of("s17", 4) == zlib.crc32(b"s17") % 4
    counts = np.bincount([unit_of(f"step3/row{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 800  # spread over every unit
    assert {unit_of("a", 1), unit_of("b", 1)} == {0}


@pytest.mark.parametrize("bad, kind", [(0, ValueError), (-2, ValueError), (True, TypeError),
                                       (2.0, TypeError), ("2", TypeError)])
def test_a_bad_unit_count_is_refused_naming_it_before_ray_starts(bad, kind):
    from tq_plugin.data_plane import RayDataPlane

    with pytest.raises(kind, match="num_storage_units"):
        checked_units(bad)
    with pytest.raises(kind, match="num_storage_units"):
        RayDataPlane("never", num_storage_units=bad, address="127.0.0.1:1")  # no cluster reached


def test_the_controller_validates_a_stand_in_and_keeps_the_units_reference():
    ref = object()  # any handle: stage_block hands it back, the bytes never read
    payload = ("enc", None, [("logprobs", "jagged", "float32", StagedBlock(ref, (12,)),
                              np.array([0, 5, 12])),
                             ("scores", "dense", "bfloat16", StagedBlock(ref, (3, 4)), None)])
    fields = decode_fields(payload)
    lp, sc = fields["logprobs"], fields["scores"]
    assert lp.is_nested and lp._values.shape == (12,) and lp._values.stride() == (0,)
    assert sc.dtype == torch.bfloat16 and sc.shape == (3, 4) and sc.stride() == (0, 0)
    assert stage_block(lp._values) == (ref, 12, 48)
    assert stage_block(sc) == (ref, 3, 24)
    assert stage_block(sc.reshape(-1)) == (ref, 12, 24)  # a view (a dense put into a jagged field)
    own = torch.arange(4.0)
    held, elements, nbytes = stage_block(own)  # a block of its own: copied, not the unit's
    assert held is not ref and np.array_equal(held, own.numpy()) and (elements, nbytes) == (4, 16)
    del fields, lp, sc
    gc.collect()
    assert not ray_columns._STAGED_REFS  # the references go with the stand-ins


# ---------------------------------------------------------------- on Ray (slow)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_puts_bytes_live_on_the_unit_its_first_id_hashes_to(ray_session):
    import ray

    from tq_plugin.data_plane import RayDataPlane

    client = RayDataPlane(f"shard-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests",
                          num_storage_units=2)
    units = client.storage_units.units
    owner = [ray.get(u.stage.remote([np.zeros(4)]))[0].owner_address() for u in units]
    assert owner[0] != owner[1]
    try:
        client.register_partition("p", [], consumer_tasks=["train"])
        big = 4096  # tokens a row: a logprob block of 8 rows is 128 KB, past min_bytes
        puts, expect = [], {}
        for k in range(6):
            ids = [f"step0/w{k}/r{i}" for i in range(8)]
            lengths = torch.full((8,), big)
            lp = torch.randn(8 * big)
            client.put_samples(partition_id="p", sample_ids=ids, fields={
                "logprobs": nested_from_lengths(lp, lengths), "input_lengths": lengths,
                "reward": torch.randn(8)})
            puts.append(ids)
            expect.update({s: lp[i * big:(i + 1) * big] for i, s in enumerate(ids)})
        homes = {unit_of(ids[0], 2) for ids in puts}
        assert homes == {0, 1}, "the six puts should hash to both units"
        for ids in puts:
            plan = client._call("locate", partition_id="p", sample_ids=ids,
                                select_fields=["logprobs", "reward", "input_lengths"])
            (ref,) = plan["fields"]["logprobs"][3]
            assert ref.owner_address() == owner[unit_of(ids[0], 2)]
            # Small blocks stay in the controller, as with one actor.
            assert isinstance(plan["fields"]["reward"][3][0], np.ndarray)
        # A claim hands each row out once; the read gathers rows of both units in one call.
        got = []
        while True:
            meta = client.claim_meta("p", "train", ["logprobs"], batch_size=20, blocking=False)
            if not meta.size:
                break
            td = client.get_data(meta)
            for s, row in zip(meta.sample_ids, td["logprobs"].unbind()):
                assert torch.equal(row, expect[s])
            got += meta.sample_ids
        assert sorted(got) == sorted(expect) and len(got) == len(set(got))
        # A pickled client (a worker's) attaches with the same units and stages through them
        # (one row of 16,384 float32 logprobs: 64 KB, the smallest block a unit takes).
        other = pickle.loads(pickle.dumps(client))
        assert other.num_storage_units == 2 and not other.is_owner
        row = torch.ones(4 * big)
        other.put_samples(partition_id="p", sample_ids=["late"],
                          fields={"logprobs": nested_from_lengths(row, torch.tensor([4 * big]))})
        plan = client._call("locate", partition_id="p", sample_ids=["late"], select_fields=["logprobs"])
        assert plan["fields"]["logprobs"][3][0].owner_address() == owner[unit_of("late", 2)]
        other.close()
        client.clear_samples(partition_id="p", sample_ids=None)
        assert client.list_sample_ids("p") == [] and client.stats()["live_bytes"] == 0
    finally:
        client.close()


def _plasma_objects(ray) -> int:
    """Objects in this cluster's shared-memory object store."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(next(x for x in text.splitlines() if "Plasma memory usage" in x).split()[5])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_units_objects_go_when_their_rows_are_cleared_or_their_put_is_refused(ray_session):
    """The controller borrows a unit's objects: a clear, and a put it refuses after the unit
    staged the bytes, leave the object store as it was (Ray's reference counting frees them)."""
    import time

    from tq_plugin.data_plane import RayDataPlane

    client = RayDataPlane(f"shard-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests",
                          num_storage_units=2)
    try:
        client.register_partition("p", ["x"])
        gc.collect()  # references earlier tests left in cycles: their objects go first
        before, settled = _plasma_objects(ray_session), time.monotonic() + 30
        while time.monotonic() < settled:  # Ray frees objects asynchronously
            time.sleep(1.0)
            now = _plasma_objects(ray_session)
            if now == before:
                break
            before = now
        ids = [f"a{i}" for i in range(8)]
        x = torch.randn(8, 1 << 15)  # 1 MiB: staged on a unit
        client.put_samples(partition_id="p", sample_ids=ids, fields={"x": x})
        assert _plasma_objects(ray_session) > before
        with pytest.raises(ValueError, match="not declared"):  # staged, then refused
            client.put_samples(partition_id="p", sample_ids=["b0", "b1"],
                               fields={"y": torch.randn(2, 1 << 17)})
        assert client.list_sample_ids("p") == ids
        got = client.get_samples(partition_id="p", sample_ids=ids, select_fields=["x"])["x"]
        assert torch.equal(got, x)
        del got
        client.clear_samples(partition_id="p", sample_ids=ids)
        deadline = time.monotonic() + 30  # Ray frees objects asynchronously
        while _plasma_objects(ray_session) > before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _plasma_objects(ray_session) == before
    finally:
        client.close()
