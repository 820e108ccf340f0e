"""Store checkpoints written by earlier code still load: ``tests/data/store_checkpoint/v<N>/`` holds
a checkpoint of each format version, committed as the code of that version wrote it.

A change to what ``save`` writes must bump ``FORMAT_VERSION`` (``tq_plugin/data_plane/checkpoint.py``)
and commit the new version's directory beside the old ones, written from :func:`committed_store`::

    python tests/data_plane/test_checkpoint_format.py tests/data/store_checkpoint/v<N>

The old directories stay, and their tests keep asking that they load (or a reader that can no
longer load them is a decision, taken by deleting their test with the reason).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths
from tq_plugin.data_plane.checkpoint import FORMAT_VERSION, MANIFEST, load_into

COMMITTED = Path(__file__).resolve().parents[1] / "data" / "store_checkpoint"
METADATA = {"step": 3, "meta": {"partition_id": "train", "sample_ids": ["r0", "r3"]}}


def _jagged(lengths: list[int], dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    values = torch.arange(start, start + sum(lengths)).to(dtype)
    return nested_from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def committed_store() -> LocalDataPlane:
    """The store every committed version holds (no randomness): an open and a closed schema,
    jagged and dense fields of several dtypes and trailing dims, a row that lacks a field, an
    overwritten row, a cleared slot reused, tags, claims, an empty partition."""
    s = LocalDataPlane()
    s.register_partition("train", [], consumer_tasks=["train", "eval"], grpo_group_size=2,
                         enums={"status": ["ok", "bad"]})
    s.put_samples(partition_id="train", sample_ids=["r0", "r1", "r2", "r3"], fields={
        "input_ids": _jagged([3, 1, 0, 2], torch.int64),
        "generation_logprobs": _jagged([3, 1, 0, 2], torch.float32, start=-6),
        "advantages": torch.tensor([0.5, -1.25, 0.0, 2.0]),
        "pair": torch.arange(8, dtype=torch.bfloat16).reshape(4, 2),
        "sample_mask": torch.tensor([True, True, False, True]),
    }, tags=[{"status": "ok", "n": None, "l": [1, "a", {"d": True}]}, {}, {"f": 0.25}, {"k": 3}])
    s.put_samples(partition_id="train", sample_ids=["r1", "r4"],
                  fields={"advantages": torch.tensor([7.0, 8.0])}, tags=[{"again": 1}, {}])
    s.clear_samples(partition_id="train", sample_ids=["r2"])
    s.put_samples(partition_id="train", sample_ids=["r5"],
                  fields={"input_ids": _jagged([4], torch.int64, start=100)})
    s.claim_meta("train", "train", ["advantages"], batch_size=2)
    s.register_partition("closed", ["ids", "mask"], num_samples=4, jagged_fields=["ids"])
    s.put_samples(partition_id="closed", sample_ids=["c0", "c1"], fields={
        "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "mask": torch.tensor([[True, False], [False, True]])})
    s.register_partition("empty", ["x"], consumer_tasks=["train"])
    return s


def _state(store: LocalDataPlane) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """The whole store: every partition's schema, ids in first-put order, tags, claims, fields."""
    return [(p.entry, p.tensors) for p in store.snapshot_partitions()]


def _assert_same_state(got: list, want: list) -> None:
    assert [entry for entry, _ in got] == [entry for entry, _ in want]
    for (entry, a), (_, b) in zip(got, want, strict=True):
        assert a.keys() == b.keys(), entry["partition_id"]
        for key, x in b.items():
            assert (a[key].dtype, a[key].shape) == (x.dtype, x.shape), (entry["partition_id"], key)
            assert torch.equal(a[key], x), (entry["partition_id"], key)


def _versions() -> list[int]:
    return sorted(int(p.name[1:]) for p in COMMITTED.glob("v*") if p.name[1:].isdigit())


def test_a_checkpoint_of_the_current_format_is_committed():
    assert FORMAT_VERSION in _versions(), (
        f"FORMAT_VERSION is {FORMAT_VERSION} but {COMMITTED}/v{FORMAT_VERSION} is not "
        "committed: write it as the module docstring says")


@pytest.mark.parametrize("version", _versions())
def test_a_committed_checkpoint_loads_whole(version):
    path = COMMITTED / f"v{version}"
    assert json.loads((path / MANIFEST).read_text())["format_version"] == version
    store = LocalDataPlane()
    restored = load_into(store, path)
    assert restored.partition_ids == ["closed", "empty", "train"]
    assert restored.metadata == METADATA
    _assert_same_state(_state(store), _state(committed_store()))
    # the claims came back: r0 and r1 were claimed before the save
    assert store.claim_meta("train", "train", ["advantages"], 8, blocking=False).sample_ids == \
        ["r3", "r4"]
    store.close()


def test_save_writes_the_committed_format_of_its_version(tmp_path):
    """What ``save`` writes now equals the committed directory of ``FORMAT_VERSION``: the manifest
    (less the tensor files' digests) and every tensor and its safetensors metadata. A change
    here is a format change: bump FORMAT_VERSION and commit the new version (module docstring)."""
    committed_store().save(tmp_path / "now", metadata=METADATA)
    now, then = tmp_path / "now", COMMITTED / f"v{FORMAT_VERSION}"
    bump = (f"save no longer writes format_version {FORMAT_VERSION} as committed in {then}: "
            f"bump FORMAT_VERSION and commit the new format (module docstring)")

    def manifest(path: Path) -> dict:
        m = json.loads((path / MANIFEST).read_text())
        for part in m["partitions"]:
            part.pop("sha256")
        return m

    assert manifest(now) == manifest(then), bump
    files = sorted(p.name for p in now.iterdir())
    assert files == sorted(p.name for p in then.iterdir()), bump
    for name in files:
        if name.endswith(".safetensors"):
            a, b = load_file(str(now / name)), load_file(str(then / name))
            assert a.keys() == b.keys(), (name, bump)
            for key in a:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (name, key)
            assert _st_metadata(now / name) == _st_metadata(then / name), (name, bump)


def _st_metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


if __name__ == "__main__":
    committed_store().save(sys.argv[1], metadata=METADATA)
