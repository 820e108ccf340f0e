"""``LocalDataPlane.save`` / ``load``: a faithful round trip, an atomic swap, and a clear
rejection of every missing, truncated, modified or foreign checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths
from tq_plugin.data_plane.checkpoint import (
    MANIFEST,
    MANIFEST_DIGEST,
    CheckpointError,
    load_into,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _values(n: int, dtype: torch.dtype, *trailing: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((n, *trailing), generator=g) * 50).to(dtype)


def _ragged(lengths: list[int], dtype: torch.dtype, *trailing: int, seed: int = 0) -> torch.Tensor:
    values = _values(sum(lengths), dtype, *trailing, seed=seed)
    return nested_from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def _populated() -> LocalDataPlane:
    """Every dtype dense and jagged, trailing dims, rows lacking a field, cleared and reused
    slots, tags, claims, a closed and an open schema, and an empty partition."""
    s = LocalDataPlane()
    s.register_partition("open", [], consumer_tasks=["train", "eval"], grpo_group_size=2,
                         enums={"status": ["ok", "bad"]})
    for i, dt in enumerate(DTYPES):
        s.put_samples(partition_id="open", sample_ids=[f"r{i}a", f"r{i}b", f"r{i}c"], fields={
            f"dense_{dt}": _values(3, dt, 2, seed=i),
            f"jag_{dt}": _ragged([2, 0, 5], dt, seed=i),
            "scalar": torch.arange(3) + 10 * i,
            "tokens": _ragged([1, 3, 2], torch.int64, 4, seed=i),
        }, tags=[{"k": i, "f": 0.5, "s": "x", "n": None, "l": [1, "a", {"d": True}]}, {}, {"k": i}])
    s.put_samples(
        partition_id="open", sample_ids=["r0a", "late"], fields={"scalar": torch.tensor([-1, -2])}
    )  # overwrite + new
    s.clear_samples(partition_id="open", sample_ids=["r1b", "r2c"])  # freed slots ...
    s.put_samples(
        partition_id="open", sample_ids=["reuse"], fields={"scalar": torch.tensor([7])}
    )  # ... reused, arrives last
    s.claim_meta("open", "train", ["scalar"], batch_size=4)
    s.register_partition("closed", ["ids", "mask"], num_samples=8, jagged_fields=["ids"])
    s.put_samples(partition_id="closed", sample_ids=["c0", "c1"], fields={"ids": torch.arange(6).reshape(2, 3),
                                           "mask": torch.tensor([True, False])})
    s.register_partition("empty", ["x"], consumer_tasks=["train"])
    s.register_partition("hollow", [])  # a jagged column whose rows are all empty
    s.put_samples(
        partition_id="hollow",
        sample_ids=["h0", "h1"],
        fields={"j": _ragged([0, 0], torch.float32, 3)},
    )
    return s


def _state(s: LocalDataPlane) -> dict[str, Any]:
    """Everything observable through the client API, plus the claims (per task, in order)."""
    out: dict[str, Any] = {}
    for pid in s.list_partitions():
        part = s._partitions[pid]
        ids = s.list_sample_ids(pid)
        fields = {}
        for name in sorted(part.columns):
            have = [sid for sid in ids if bool(part.columns[name].has(
                torch.tensor([part.slot_of[sid]]).numpy())[0])]
            if not have:
                continue
            value = s.get_samples(partition_id=pid, sample_ids=have, select_fields=[name])[name]
            if value.is_nested:
                fields[name] = (have, value.values().clone(), value.offsets().clone())
            else:
                fields[name] = (have, value.clone())
        order = sorted(part.slot_of, key=lambda sid: int(part.arrival[part.slot_of[sid]]))
        out[pid] = {
            "ids": ids, "fields": fields, "tags": s.get_tags(
                partition_id=pid, sample_ids=ids
            ), "arrival": order,
            "declared": sorted(part.declared), "jagged": sorted(part.jagged),
            "num_samples": part.num_samples, "tasks": part.consumer_tasks,
            "group": part.grpo_group_size, "enums": part.enums,
            "consumed": {t: sorted(c) for t, c in part.consumed.items()},
        }
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for pid, pa in a.items():
        pb = b[pid]
        assert {k: v for k, v in pa.items() if k != "fields"} == {
            k: v for k, v in pb.items() if k != "fields"}, pid
        assert pa["fields"].keys() == pb["fields"].keys(), pid
        for name, va in pa["fields"].items():
            vb = pb["fields"][name]
            assert va[0] == vb[0], name
            for ta, tb in zip(va[1:], vb[1:]):
                assert ta.dtype == tb.dtype and ta.shape == tb.shape, name
                assert torch.equal(ta, tb), name


def test_round_trip_keeps_rows_schema_tags_and_claims(tmp_path: Path) -> None:
    src = _populated()
    src.save(tmp_path / "ck")
    restored = LocalDataPlane.load(tmp_path / "ck")
    before = _state(src)
    _assert_same(before, _state(restored))
    assert before["open"]["consumed"]["train"]  # the claims state is not trivially empty
    assert before["empty"]["ids"] == [] and "empty" in restored.list_partitions()
    # Claims continue where they stopped, in first-put order, on both stores alike.
    nxt = [s.claim_meta("open", "train", ["scalar"], 100, blocking=False).sample_ids
           for s in (src, restored)]
    assert nxt[0] == nxt[1] and nxt[0][-1] == "reuse"
    # The restored store is a live one: the schema still rejects what it rejected before.
    with pytest.raises(ValueError, match="not declared"):
        restored.put_samples(
            partition_id="closed", sample_ids=["z"], fields={"other": torch.zeros(1)}
        )
    with pytest.raises(TypeError, match="dtype mismatch"):
        restored.put_samples(
            partition_id="open", sample_ids=["z"], fields={"scalar": torch.zeros(1)}
        )


def test_saving_again_replaces_the_checkpoint_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    s = LocalDataPlane()
    s.register_partition("p", [])
    s.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1)})
    s.save(tmp_path / "ck")
    s.put_samples(partition_id="p", sample_ids=["b"], fields={"x": torch.zeros(1)})
    s.clear_samples(partition_id="p", sample_ids=["a"])
    s.save(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert LocalDataPlane.load(tmp_path / "ck").list_sample_ids("p") == ["b"]


def test_a_crash_between_the_two_renames_leaves_the_old_checkpoint_loadable(tmp_path: Path) -> None:
    s = LocalDataPlane()
    s.register_partition("p", [])
    s.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1)})
    s.save(tmp_path / "ck")
    # What a crash leaves after the old checkpoint was renamed aside: no <path>, a complete
    # <path>.old-*, and a new <path>.tmp-* (complete or not; never trusted).
    os.rename(tmp_path / "ck", tmp_path / "ck.old-1234")
    (tmp_path / "ck.tmp-5678").mkdir()
    assert LocalDataPlane.load(tmp_path / "ck").list_sample_ids("p") == ["a"]
    s.put_samples(partition_id="p", sample_ids=["b"], fields={"x": torch.ones(1)})
    s.save(tmp_path / "ck")  # the next save cleans up both leftovers
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert LocalDataPlane.load(tmp_path / "ck").list_sample_ids("p") == ["a", "b"]


def test_untaggable_values_raise_before_anything_is_written(tmp_path: Path) -> None:
    for bad, rule in (((1, 2), "tuple"), (float("nan"), "finite"), ({1: "x"}, "non-string key"),
                      (torch.ones(1), "Tensor")):
        s = LocalDataPlane()
        s.register_partition("p", [])
        s.put_samples(
            partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1)}, tags=[{"bad": bad}]
        )
        with pytest.raises((TypeError, ValueError),
                           match=rf"tag 'bad' of sample 'a' in partition 'p'.*{rule}"):
            s.save(tmp_path / "ck")
        assert os.listdir(tmp_path) == []


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    s = LocalDataPlane()
    with pytest.raises(CheckpointError, match="not a checkpoint; refusing"):
        s.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_save_after_close_raises(tmp_path: Path) -> None:
    s = LocalDataPlane()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.save(tmp_path / "ck")


# ---------------------------------------------------------------------- rejection
@pytest.fixture
def ck(tmp_path: Path) -> Path:
    s = LocalDataPlane()
    s.register_partition("p", [], consumer_tasks=["t"])
    s.put_samples(partition_id="p", sample_ids=["a", "b"], fields={"d": torch.arange(4.0).reshape(2, 2),
                                    "j": _ragged([3, 1], torch.float32)}, tags=[{"k": 1}, {}])
    s.save(tmp_path / "ck")
    return tmp_path / "ck"


def _rewrite_manifest(ck: Path, change: Any) -> None:
    """Edit the manifest and re-seal it: what a careless tool (or an attacker) would do."""
    manifest = json.loads((ck / MANIFEST).read_text())
    change(manifest)
    text = json.dumps(manifest).encode()
    (ck / MANIFEST).write_bytes(text)
    (ck / MANIFEST_DIGEST).write_text(hashlib.sha256(text).hexdigest())


def _reseal_partition(ck: Path, data: bytes) -> None:
    (ck / "0.safetensors").write_bytes(data)

    def fix(m: dict) -> None:
        m["partitions"][0]["sha256"] = hashlib.sha256(data).hexdigest()

    _rewrite_manifest(ck, fix)


def _field(m: dict, name: str) -> dict:
    return next(f for f in m["partitions"][0]["fields"] if f["name"] == name)


def test_the_fixture_checkpoint_loads(ck: Path) -> None:
    assert LocalDataPlane.load(ck).list_sample_ids("p") == ["a", "b"]


@pytest.mark.parametrize("name, rule", [
    (MANIFEST_DIGEST, "manifest.sha256.*missing.*incomplete"),
    (MANIFEST, "manifest.json.*missing"),
    ("0.safetensors", "0.safetensors.*missing.*partition 'p'"),
])
def test_a_missing_file_is_rejected(ck: Path, name: str, rule: str) -> None:
    (ck / name).unlink()
    with pytest.raises(CheckpointError, match=rule):
        LocalDataPlane.load(ck)


def test_no_checkpoint_at_all_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        LocalDataPlane.load(tmp_path / "nothing")


@pytest.mark.parametrize("name", [MANIFEST, "0.safetensors"])
def test_a_flipped_byte_is_rejected(ck: Path, name: str) -> None:
    data = bytearray((ck / name).read_bytes())
    data[-3] ^= 0x01
    (ck / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{name}.*does not match its sha256"):
        LocalDataPlane.load(ck)


@pytest.mark.parametrize("name", [MANIFEST, "0.safetensors"])
def test_a_truncated_file_is_rejected(ck: Path, name: str) -> None:
    data = (ck / name).read_bytes()
    (ck / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{name}.*does not match its sha256"):
        LocalDataPlane.load(ck)


def test_a_truncated_safetensors_file_with_a_matching_digest_is_rejected(ck: Path) -> None:
    data = (ck / "0.safetensors").read_bytes()
    _reseal_partition(ck, data[: len(data) - 5])
    with pytest.raises(CheckpointError, match="0.safetensors.*not a valid safetensors file"):
        LocalDataPlane.load(ck)


def test_an_unknown_format_version_is_rejected(ck: Path) -> None:
    _rewrite_manifest(ck, lambda m: m.update(format_version=2))
    with pytest.raises(CheckpointError, match="format_version 2.*reads format_version 1"):
        LocalDataPlane.load(ck)


def test_a_foreign_json_is_rejected(ck: Path) -> None:
    _rewrite_manifest(ck, lambda m: m.update(format="something.else"))
    with pytest.raises(CheckpointError, match="is not a tq_plugin.local_store checkpoint"):
        LocalDataPlane.load(ck)


def test_a_malformed_manifest_is_rejected(ck: Path) -> None:
    _rewrite_manifest(ck, lambda m: m["partitions"][0].update(sample_ids="a,b"))
    with pytest.raises(CheckpointError, match="manifest.json.*malformed.*sample_ids"):
        LocalDataPlane.load(ck)


@pytest.mark.parametrize("change, rule", [
    # rows the tensors do not have
    (lambda m: m["partitions"][0].update(sample_ids=["a"]), "row indices must be distinct"),
    (lambda m: _field(m, "d").update(shape=[3]), "field 'd'.*data has shape \\(2, 2\\)"),
    (lambda m: _field(m, "j").update(shape=[1]), "field 'j'.*values have shape"),
    (lambda m: _field(m, "d").update(dtype="float64"), "field 'd'.*manifest says float64"),
    (lambda m: _field(m, "d").update(dtype="object"), "unsupported dtype 'object'"),
    (lambda m: m["partitions"][0]["fields"].append(
        {"name": "ghost", "kind": "dense", "dtype": "float32", "shape": []}),
     "field 'ghost'.*names tensors \\['2.rows', '2.data'\\] it does not hold"),
    (lambda m: m["partitions"][0]["fields"].pop(), "holds tensors the manifest does not name"),
    (lambda m: m["partitions"][0]["sample_ids"].append("a"), "lists a sample id twice"),
    (lambda m: m["partitions"][0]["tags"].update(zz={}), "tags name rows that are not in"),
    (lambda m: m["partitions"][0]["consumed"].update(t=["zz"]), "task 't' claimed rows not in"),
])
def test_a_manifest_that_disagrees_with_the_tensors_is_rejected(
    ck: Path, change: Any, rule: str
) -> None:
    _rewrite_manifest(ck, change)
    with pytest.raises(CheckpointError, match=rf"0.safetensors.*{rule}"):
        LocalDataPlane.load(ck)


def test_jagged_lengths_that_disagree_with_the_values_are_rejected(ck: Path) -> None:
    from safetensors.torch import load, save

    tensors = load((ck / "0.safetensors").read_bytes())
    key = next(k for k in tensors if k.endswith(".lengths"))
    tensors[key] = tensors[key] + 1
    _reseal_partition(ck, save(tensors))
    with pytest.raises(CheckpointError, match="field 'j'.*lengths must be >= 0 and sum to the 4"):
        LocalDataPlane.load(ck)


def test_a_rejected_checkpoint_writes_nothing_into_the_target(ck: Path) -> None:
    _rewrite_manifest(ck, lambda m: _field(m, "j").update(shape=[1]))
    target = LocalDataPlane()
    with pytest.raises(CheckpointError):
        load_into(target, ck)
    assert target.list_partitions() == []


def test_load_into_another_client_puts_the_rows_and_warns_about_claims(ck: Path) -> None:
    class Forwarding:  # any DataPlaneClient that is not a LocalDataPlane
        def __init__(self) -> None:
            self.inner = LocalDataPlane()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.__dict__["inner"], name)

    store = LocalDataPlane.load(ck)
    store.claim_meta("p", "t", ["d"], 1)
    store.save(ck)
    other = Forwarding()
    with pytest.warns(RuntimeWarning, match="claims of partition 'p' are not restored"):
        assert load_into(other, ck).partition_ids == ["p"]
    got = other.get_samples(partition_id="p", sample_ids=["b", "a"], select_fields=["d", "j"])
    assert torch.equal(got["d"], torch.tensor([[2.0, 3.0], [0.0, 1.0]]))
    assert got["j"].offsets().tolist() == [0, 1, 4]


def test_metadata_round_trips_and_is_validated_like_tags(tmp_path: Path) -> None:
    from tq_plugin.data_plane.checkpoint import save_store

    s = LocalDataPlane()
    note = {"step": 3, "meta": {"sample_ids": ["a"], "extra_info": {"pad": 8}}}
    save_store(s, tmp_path / "ck", metadata=note)
    assert load_into(LocalDataPlane(), tmp_path / "ck").metadata == note
    with pytest.raises(TypeError, match=r"save: metadata\['when'\] is a tuple"):
        save_store(s, tmp_path / "ck2", metadata={"when": (1, 2)})
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_each_restored_row_lands_whole_in_one_put(tmp_path: Path) -> None:
    puts: list[tuple[list[str], list[str]]] = []

    class Recording(LocalDataPlane):
        def put_samples(self, sample_ids: Any, partition_id: str, fields: Any = None,
                        tags: Any = None) -> Any:
            if fields is not None:
                puts.append((list(sample_ids), sorted(fields)))
            return super().put_samples(
                partition_id=partition_id, sample_ids=sample_ids, fields=fields, tags=tags
            )

    s = LocalDataPlane()
    s.register_partition("p", [])
    s.put_samples(
        partition_id="p",
        sample_ids=["a", "b", "c"],
        fields={"x": torch.ones(3), "j": _ragged([1, 2, 3], torch.int32)},
    )
    s.put_samples(
        partition_id="p", sample_ids=["b"], fields={"y": torch.zeros(1, 2)}
    )  # a write-back for one row
    s.save(tmp_path / "ck")
    load_into(Recording(), tmp_path / "ck")
    held = {"a": ["j", "x"], "b": ["j", "x", "y"], "c": ["j", "x"]}
    assert sorted(puts) == [(["a", "c"], held["a"]), (["b"], held["b"])]


# ---------------------------------------------------------------------- the Ray-hosted store
@pytest.fixture
def ray_store(ray_session):
    import uuid

    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    store = RayDataPlane(f"ckpt-{uuid.uuid4().hex[:8]}", actor_name="tq_plugin_tests")
    yield store
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ray_store_saves_and_restores_the_embedded_format(tmp_path: Path, ray_store) -> None:
    """The actor runs the embedded store's checkpoint code: a local checkpoint restored into
    the Ray store and saved from it again comes back identical (rows, tags, claims, order),
    and every file is digested in the manifest."""
    src = _populated()
    src.save(tmp_path / "local")
    assert ray_store.restore(tmp_path / "local").partition_ids == sorted(src.list_partitions())
    ray_store.save(tmp_path / "ray", metadata={"step": 3})
    manifest = json.loads((tmp_path / "ray" / MANIFEST).read_text())
    for i, part in enumerate(manifest["partitions"]):
        blob = (tmp_path / "ray" / f"{i}.safetensors").read_bytes()
        assert part["sha256"] == hashlib.sha256(blob).hexdigest()
    back = LocalDataPlane.load(tmp_path / "ray")
    _assert_same(_state(src), _state(back))
    assert load_into(LocalDataPlane(), tmp_path / "ray").metadata == {"step": 3}
    # The restored claims live in the actor's store: the next claim continues where src's does.
    nxt = ray_store.claim_meta("open", "train", ["scalar"], 100, blocking=False).sample_ids
    assert nxt == src.claim_meta("open", "train", ["scalar"], 100, blocking=False).sample_ids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ray_store_swaps_its_checkpoint_in_atomically(tmp_path: Path, ray_store) -> None:
    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane

    ray_store.register_partition("p", [])
    ray_store.put_samples(
        partition_id="p",
        sample_ids=["a"],
        fields={"x": torch.ones(1), "j": _ragged([70_000], torch.uint8)},
    )
    ray_store.save(tmp_path / "ck")
    ray_store.put_samples(partition_id="p", sample_ids=["b"], fields={"x": torch.zeros(1)})
    ray_store.clear_samples(partition_id="p", sample_ids=["a"])
    ray_store.save(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    loaded = RayDataPlane.load(tmp_path / "ck", store=f"{ray_store.store}-2",
                               actor_name="tq_plugin_tests")
    try:
        assert loaded.list_sample_ids("p") == ["b"]
        assert loaded.get_samples(
            partition_id="p", sample_ids=["b"], select_fields=["x"]
        )["x"].tolist() == [0.0]
    finally:
        loaded.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ray_store_refuses_a_tampered_checkpoint_and_stays_unchanged(
        tmp_path: Path, ray_store) -> None:
    s = LocalDataPlane()
    s.register_partition("p", [])
    s.put_samples(partition_id="p", sample_ids=["a", "b"], fields={"d": torch.arange(4.0).reshape(2, 2),
                                    "j": _ragged([100_000, 1], torch.float32)})
    s.save(tmp_path / "ck")
    data = bytearray((tmp_path / "ck" / "0.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "ck" / "0.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        ray_store.restore(tmp_path / "ck")
    assert ray_store.list_partitions() == []


def _rank(root: Path, rank: int, barriers: list[int]) -> Any:
    """What ``DataPlaneCallback`` reads of a Trainer, for rank ``rank`` of two."""
    from types import SimpleNamespace

    strategy = SimpleNamespace(barrier=lambda name: barriers.append(rank))
    return SimpleNamespace(global_rank=rank, is_global_zero=rank == 0, world_size=2,
                           default_root_dir=str(root), global_step=7, strategy=strategy)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_callback_checkpoints_a_shared_ray_store_from_rank_zero_alone(
        tmp_path: Path, ray_store) -> None:
    from types import SimpleNamespace

    from tq_plugin.data_plane.backends.ray_actor import RayDataPlane
    from tq_plugin.lightning.callback import DataPlaneCallback

    barriers: list[int] = []

    def ranks(owner: RayDataPlane) -> list[tuple[DataPlaneCallback, Any]]:
        out = []
        for r in (0, 1):
            client = owner if r == 0 else RayDataPlane(owner.store, actor_name="tq_plugin_tests")
            cb = DataPlaneCallback(client, role="policy")
            trainer = _rank(tmp_path, r, barriers)
            cb.setup(trainer, SimpleNamespace(), "fit")
            out.append((cb, trainer))
        return out

    ray_store.register_partition("p", [], consumer_tasks=["train"])
    ray_store.put_samples(
        partition_id="p", sample_ids=["a", "b", "c"], fields={"x": torch.arange(3.0)}
    )
    first = ray_store.claim_meta("p", "train", ["x"], 1).sample_ids
    states = []
    for cb, trainer in ranks(ray_store):
        checkpoint = {"callbacks": {cb.state_key: cb.state_dict()}}
        cb.on_save_checkpoint(trainer, SimpleNamespace(), checkpoint)
        states.append(checkpoint["callbacks"][cb.state_key])
    base = tmp_path / "dataplane" / "policy" / "step-7"
    assert sorted(os.listdir(base)) == ["rank-0"]  # one copy of the shared rows, by rank 0
    assert states[0]["store_path"] == states[1]["store_path"] == str(base)

    fresh = RayDataPlane(f"{ray_store.store}-resumed", actor_name="tq_plugin_tests")
    try:
        resumed = ranks(fresh)
        barriers.clear()
        for (cb, trainer), state in zip(resumed, states):
            cb.on_load_checkpoint(trainer, SimpleNamespace(),
                                  {"callbacks": {cb.state_key: state}})
        assert [cb.restored_from for cb, _ in resumed] == [str(base), None]
        assert barriers == [0, 1]  # no rank goes on before rank 0 has put the rows back
        assert fresh.list_sample_ids("p") == ["a", "b", "c"]
        # The claims came back inside the actor's store: the claimed row is not handed out again.
        rest = fresh.claim_meta("p", "train", ["x"], 2, blocking=False).sample_ids
        assert first[0] not in rest and len(rest) == 2
    finally:
        fresh.close()
