"""The Ray store sharded (``RayDataPlane(num_storage_units=S)``, ``backends/ray_sharded.py``).

Its contract is the single store's: the conformance suite and the state machine run on it
(``ray_sharded``, every block put on a unit). Here: which blocks go to a unit and which unit,
the stand-in the controller validates in place of the bytes and its hold on the unit's block,
and (slow, Ray) that a put's bytes live on the unit its first sample id hashes to and outlive
a killed writer, while reads, claims and pickled clients work across units, and that a clear
or a refused put leaves nothing on a unit.
"""

from __future__ import annotations

import gc
import pickle
import time
import uuid
import zlib

import numpy as np
import pytest
import torch

from tq_plugin.data_plane import nested_from_lengths
from tq_plugin.data_plane.backends import ray_columns
from tq_plugin.data_plane.backends.ray_columns import (
    HeldKey,
    StagedBlock,
    UnitKey,
    decode_fields,
    encode_fields,
    released_keys,
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


def test_the_controller_validates_a_stand_in_and_holds_the_units_block():
    ref = UnitKey("ns", "store_unit1", 7)  # the bytes never read
    payload = ("enc", None, [("logprobs", "jagged", "float32", StagedBlock(ref, (12,)),
                              np.array([0, 5, 12])),
                             ("scores", "dense", "bfloat16", StagedBlock(ref, (3, 4)), None)])
    fields = decode_fields(payload)
    lp, sc = fields["logprobs"], fields["scores"]
    assert lp.is_nested and lp._values.shape == (12,) and lp._values.stride() == (0,)
    assert sc.dtype == torch.bfloat16 and sc.shape == (3, 4) and sc.stride() == (0, 0)
    released_keys()
    held = [stage_block(lp._values), stage_block(sc),
            stage_block(sc.reshape(-1))]  # a view (a dense put into a jagged field)
    assert [h[1:] for h in held] == [(12, 48), (3, 24), (12, 24)]
    assert all(isinstance(h[0], HeldKey) and h[0] is held[0][0] for h in held)  # one hold a key
    assert pickle.loads(pickle.dumps(held[0][0])) == ref  # a read's answer: the plain key
    own = torch.arange(4.0)
    mine, elements, nbytes = stage_block(own)  # a block of its own: copied, not the unit's
    assert np.array_equal(mine, own.numpy()) and (elements, nbytes) == (4, 16)
    del fields, lp, sc
    gc.collect()
    assert not ray_columns._STAGED_REFS  # the stand-ins' entries go with them
    assert released_keys() == {}  # still held
    del held
    gc.collect()
    assert released_keys() == {("ns", "store_unit1"): [7]}  # the last hold gone: free it once


# ---------------------------------------------------------------- on Ray (slow)
class _Writer:
    """A rollout worker's process: puts rows through a pickled client, then is killed."""

    def put(self, client, ids, values):
        lengths = torch.full((len(ids),), values.numel() // len(ids))
        return client.put_samples(partition_id="p", sample_ids=ids, fields={
            "logprobs": nested_from_lengths(values, lengths), "input_lengths": lengths}).size


def _unit_blocks(client) -> int:
    import ray

    return sum(n for n, _ in ray.get([u.held.remote() for u in client.storage_units.units]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_puts_bytes_live_on_the_unit_its_first_id_hashes_to(ray_session):
    import ray

    from tq_plugin.data_plane import RayDataPlane
    from tq_plugin.data_plane.backends.ray_columns import UnitKey

    client = RayDataPlane(f"shard-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests",
                          num_storage_units=2)
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
            (where,) = plan["fields"]["logprobs"][3]
            assert isinstance(where, UnitKey)
            assert where.unit == f"tq_plugin_tests_unit{unit_of(ids[0], 2)}"
            # Small blocks stay in the controller, as with one actor.
            assert isinstance(plan["fields"]["reward"][3][0], np.ndarray)
        assert _unit_blocks(client) >= 6  # one logprobs block a put (units serve other stores)
        # A writer that is killed once its put returned loses nothing: the unit keeps the bytes.
        writer = ray.remote(_Writer).options(num_cpus=0).remote()
        late = torch.randn(2 * big)
        assert ray.get(writer.put.remote(client, ["w9/r0", "w9/r1"], late)) == 2
        ray.kill(writer, no_restart=True)
        expect.update({"w9/r0": late[:big], "w9/r1": late[big:]})
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
        # A pickled client (a worker's) attaches with the same units and puts through them
        # (one row of 16,384 float32 logprobs: 64 KB, the smallest block a unit takes).
        other = pickle.loads(pickle.dumps(client))
        assert other.num_storage_units == 2 and not other.is_owner
        row = torch.ones(4 * big)
        other.put_samples(partition_id="p", sample_ids=["late"],
                          fields={"logprobs": nested_from_lengths(row, torch.tensor([4 * big]))})
        plan = client._call("locate", partition_id="p", sample_ids=["late"], select_fields=["logprobs"])
        assert plan["fields"]["logprobs"][3][0].unit == f"tq_plugin_tests_unit{unit_of('late', 2)}"
        other.close()
        client.clear_samples(partition_id="p", sample_ids=None)
        assert client.list_sample_ids("p") == [] and client.stats()["live_bytes"] == 0
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_units_blocks_go_when_their_rows_are_cleared_or_their_put_is_refused(ray_session):
    """A clear frees the unit's blocks (the controller tells it after the call), and a put the
    controller refuses leaves nothing on the unit; the refusal is the controller's own error,
    also for a put forwarded together with others."""
    import time

    from tq_plugin.data_plane import RayDataPlane

    client = RayDataPlane(f"shard-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests",
                          num_storage_units=2)
    try:
        client.register_partition("p", ["x"])
        gc.collect()
        before = _unit_blocks(client)
        ids = [f"a{i}" for i in range(8)]
        x = torch.randn(8, 1 << 15)  # 1 MiB: kept on a unit
        client.put_samples(partition_id="p", sample_ids=ids, fields={"x": x})
        assert _unit_blocks(client) == before + 1
        with pytest.raises(ValueError, match="not declared"):  # routed to a unit, then refused
            client.put_samples(partition_id="p", sample_ids=["b0", "b1"],
                               fields={"y": torch.randn(2, 1 << 17)})
        assert _unit_blocks(client) == before + 1
        assert client.list_sample_ids("p") == ids
        got = client.get_samples(partition_id="p", sample_ids=ids, select_fields=["x"])["x"]
        assert torch.equal(got, x)
        # Puts that reach a unit together go to the controller together (one call), each
        # applied on its own: every put gets its own receipt, the bad one its own error.
        from concurrent.futures import ThreadPoolExecutor

        same = [s for s in (f"c{i}" for i in range(200)) if unit_of(s, 2) == 0][:12]
        bad = same[5]

        def put(sid):
            name = "y" if sid == bad else "x"
            return client.put_samples(partition_id="p", sample_ids=[sid, sid + "/b"],
                                      fields={name: torch.full((2, 1 << 15), float(len(sid)))})

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(put, sid) for sid in same]
        for sid, fut in zip(same, futures):
            if sid == bad:
                with pytest.raises(ValueError, match="not declared"):
                    fut.result()
            else:
                assert fut.result().sample_ids == [sid, sid + "/b"]
        good = [x for sid in same if sid != bad for x in (sid, sid + "/b")]
        assert sorted(client.list_sample_ids("p")) == sorted(ids + good)
        back = client.get_samples(partition_id="p", sample_ids=good, select_fields=["x"])["x"]
        assert torch.equal(back[:, 0], torch.tensor([float(len(s.split("/")[0])) for s in good]))
        client.clear_samples(partition_id="p", sample_ids=ids + good)
        deadline = time.monotonic() + 30  # the free is sent after the clear's call
        while _unit_blocks(client) > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _unit_blocks(client) == before
    finally:
        client.close()


class _Gate:
    """A stand-in controller whose ``call_batch`` waits until released, recording each batch."""

    def __init__(self):
        import threading

        self.open, self.batches = threading.Event(), []

    def call_batch(self, calls):
        self.batches.append(len(calls))
        self.open.wait(60)
        return [(True, f"receipt {kwargs['sample_ids'][0]}") for _, kwargs in calls]

    def release(self):
        self.open.set()
        return self.batches


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_puts_waiting_on_the_controller_leave_a_unit_free_to_read_and_go_in_one_batch(ray_session):
    """Puts wait in a unit's own thread group: with more puts waiting on a stalled controller
    than the group has threads, the unit still answers a read (the controller may read a unit
    under its lock); released, the puts that queued behind the first go in one batch."""
    import ray

    from tq_plugin.data_plane.backends.ray_sharded import _PUTS, StorageUnits

    name = f"gate-{uuid.uuid4().hex[:8]}"
    gate = ray.remote(_Gate).options(name=name, namespace="tq_plugin", num_cpus=0,
                                     max_concurrency=4).remote()
    unit = StorageUnits(name, "tq_plugin", 1).units[0]
    payload = encode_fields({"x": torch.ones(2, 4)})
    puts = [unit.put.options(concurrency_group=_PUTS).remote(
        "s", {"sample_ids": [f"r{i}", f"r{i}b"], "partition_id": "p", "fields": payload}, [0], 60.0)
        for i in range(24)]  # more than the 16 threads puts have
    deadline = time.monotonic() + 60
    while ray.get(unit.held.remote(), timeout=20)[0] < 16 and time.monotonic() < deadline:
        time.sleep(0.1)  # a read answered while every put thread waits
    assert ray.get(unit.held.remote(), timeout=20)[0] >= 16
    ray.get(gate.release.remote(), timeout=20)
    assert ray.get(puts, timeout=60) == [f"receipt r{i}" for i in range(24)]
    batches = ray.get(gate.release.remote(), timeout=20)
    assert sum(batches) == 24 and max(batches) > 1  # the waiting puts went together
    ray.kill(unit)
    ray.kill(gate)
