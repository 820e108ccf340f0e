"""The embedded store's journal (issue 37): every acknowledged call comes back, byte-exact.

In-process, fast: a store's calls are journaled, the store is dropped (as a killed process
would leave it: nothing closed, nothing flushed by us) and a new store opened on the directory
must equal it: every partition's schema, ids in first-put order, tags, claims, each field's
kind, dtype, shape and bytes. A journal cut at any byte (a torn tail) must recover exactly the
calls whose records ended before the cut.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.data_plane.backends._journal import JournalError, segment_name
from tq_plugin.data_plane.jagged import nested_from_lengths


def _same(a: LocalDataPlane, b: LocalDataPlane) -> None:
    sa, sb = a.snapshot_partitions(), b.snapshot_partitions()
    assert [s.entry for s in sa] == [s.entry for s in sb]
    for x, y in zip(sa, sb):
        assert x.tensors.keys() == y.tensors.keys()
        for key in x.tensors:
            assert x.tensors[key].dtype == y.tensors[key].dtype, key
            assert torch.equal(x.tensors[key], y.tensors[key]), key


def _abandon(store: LocalDataPlane) -> None:
    """Release the journal's lock as a killed process would (the kernel drops its flock),
    without the orderly close (no final flush)."""
    journal = store.journal
    os.close(journal._fd)
    os.close(journal._lock_fd)
    journal._fd = journal._lock_fd = None
    store._journal = None


def _jagged(rng: np.random.Generator, lengths: list[int], dtype=torch.int64) -> torch.Tensor:
    values = torch.from_numpy(rng.integers(-1000, 1000, sum(lengths))).to(dtype)
    return nested_from_lengths(values, torch.tensor(lengths))


def _ops(rng: np.random.Generator):
    """A sequence of calls covering every journaled mutation and several column kinds."""
    yield lambda dp: dp.register_partition("p", [], consumer_tasks=["train"])
    yield lambda dp: dp.register_partition("q", ["a", "b"], num_samples=8, grpo_group_size=2,
                                           jagged_fields=["b"], enums={"a": ["x", "y"]})
    for i in range(6):
        n = int(rng.integers(1, 4))
        ids = [f"s{i}_{k}" for k in range(n)]
        dense = torch.from_numpy(rng.standard_normal((n, 3)).astype(np.float32))
        jag = _jagged(rng, rng.integers(0, 5, n).tolist())
        bf = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
        tags = [{"i": i, "k": k, "f": 0.5, "l": [1, "x", None]} for k in range(n)]
        yield (lambda dp, ids=ids, d=dense, j=jag, b=bf, t=tags: dp.put_samples(
            partition_id="p", sample_ids=ids, fields={"x": d, "y": j, "bf": b}, tags=t))
    for i in range(4):  # one-row puts of one layout: the buffered path
        row = torch.from_numpy(rng.standard_normal((1, 3)).astype(np.float32))
        tok = torch.from_numpy(rng.integers(0, 9, (1, int(rng.integers(1, 6)))))
        yield (lambda dp, i=i, r=row, t=tok: dp.put_samples(
            partition_id="p", sample_ids=[f"one{i}"],
            fields={"x": r, "y": t, "bf": torch.zeros(1, dtype=torch.bfloat16)}))
    # consecutive one-row puts (replayed as one put): equal lengths stay dense, a row of
    # another length turns the column jagged, as it did live; tags on some rows only
    yield lambda dp: dp.register_partition("r", [])
    for i, (n, m) in enumerate([(3, 1), (3, 1), (3, 1), (5, 2), (4, 2)]):
        tok = torch.from_numpy(rng.integers(0, 9, (1, n)))
        grid = torch.from_numpy(rng.standard_normal((1, m, 2)).astype(np.float32))
        tags = [{"i": i}] if i % 2 else None
        yield (lambda dp, i=i, t=tok, g=grid, tg=tags: dp.put_samples(
            partition_id="r", sample_ids=[f"r{i}"], fields={"tok": t, "grid": g,
                                                            "same": torch.ones(1, 2)}, tags=tg))
    yield lambda dp: dp.claim_meta("p", "train", ["x"], 4, blocking=False)
    yield lambda dp: dp.put_samples(partition_id="p", sample_ids=["s0_0"], mode="update",
                                    fields={"x": torch.full((1, 3), 7.0)}, tags=[{"new": True}])
    yield lambda dp: dp.clear_samples(partition_id="p", sample_ids=["s1_0", "one0", "nope"])
    yield lambda dp: dp.put_samples(partition_id="q", sample_ids=["a0", "a1"],
                                    fields={"a": torch.tensor([[True], [False]]),
                                            "b": torch.arange(6, dtype=torch.int16).reshape(2, 3)})
    yield lambda dp: dp.restore_claims("p", {"train": ["one3"], "other": ["s2_0"]})
    yield lambda dp: dp.put_samples(partition_id="p", sample_ids=["meta_only"], tags=[{"t": 1}])
    yield lambda dp: dp.put_samples(partition_id="p", sample_ids=["empty"],  # no bytes at all
                                    fields={"x": torch.zeros(1, 3), "y": _jagged(rng, [0]),
                                            "bf": torch.zeros(1, dtype=torch.bfloat16)})
    yield lambda dp: dp.clear_samples(partition_id="q")


def _run(dp: LocalDataPlane, seed: int = 0) -> list[int]:
    """Apply every op; the journal's size after each (one record per call)."""
    ends = []
    for op in _ops(np.random.default_rng(seed)):
        op(dp)
        ends.append((Path(dp.journal.root) / segment_name(dp.journal.seq)).stat().st_size)
    return ends


@pytest.mark.parametrize("sync", ["off", "batch", "always"])
def test_a_store_reopened_on_its_journal_holds_every_acknowledged_call(tmp_path, sync) -> None:
    dp = LocalDataPlane(journal_dir=tmp_path, journal_sync=sync)
    _run(dp)
    _abandon(dp)
    again = LocalDataPlane(journal_dir=tmp_path)
    _same(dp, again)
    # the claims came back as claims: the task goes on where it was, and gets no row twice
    assert (again.claim_meta("p", "train", ["x"], 100, blocking=False).sample_ids
            == dp.claim_meta("p", "train", ["x"], 100, blocking=False).sample_ids)
    again.close()
    dp.close()


def test_a_journal_cut_at_any_byte_recovers_exactly_the_calls_before_the_cut(tmp_path) -> None:
    """A torn tail: the record the crash cut is dropped (checksum or length), every earlier
    record comes back, nothing after it is half-present."""
    src = tmp_path / "src"
    dp = LocalDataPlane(journal_dir=src, journal_sync="off")
    reference = LocalDataPlane()
    ends = []
    segment = src / segment_name(0)
    ops = list(_ops(np.random.default_rng(1)))
    for op in ops:
        op(dp)
        ends.append(segment.stat().st_size)
    _abandon(dp)
    rng = np.random.default_rng(2)
    cuts = sorted({0, *ends, *(e - 1 for e in ends), *rng.integers(0, ends[-1], 30).tolist()})
    applied = 0
    for cut in cuts:
        while applied < len(ops) and ends[applied] <= cut:
            ops[applied](reference)
            applied += 1
        case = tmp_path / f"cut{cut}"
        shutil.copytree(src, case)
        os.truncate(case / segment_name(0), cut)
        again = LocalDataPlane(journal_dir=case)
        try:
            _same(reference, again)
            assert again.journal.recovered_records == applied
            assert again.journal.dropped_tail_bytes == cut - (ends[applied - 1] if applied else 0)
        finally:
            again.close()
        shutil.rmtree(case)
    assert len(cuts) > 40
    reference.close()
    dp.close()


def test_a_flipped_byte_drops_the_tail_but_damage_before_a_newer_segment_is_refused(tmp_path) -> None:
    dp = LocalDataPlane(journal_dir=tmp_path / "a", journal_sync="off")
    ends = _run(dp)
    _abandon(dp)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    seg = tmp_path / "a" / segment_name(0)
    data = bytearray(seg.read_bytes())
    at = (ends[5] + ends[6]) // 2  # inside record 6's payload: its checksum fails
    data[at] ^= 0xFF
    seg.write_bytes(bytes(data))
    again = LocalDataPlane(journal_dir=tmp_path / "a")
    assert again.journal.recovered_records == 6
    reference = LocalDataPlane()
    for op in list(_ops(np.random.default_rng(0)))[:6]:
        op(reference)
    _same(reference, again)
    again.close()
    # the same damage with a newer segment after it: acknowledged records are unreadable
    seg_b = tmp_path / "b" / segment_name(0)
    seg_b.write_bytes(bytes(data))
    (tmp_path / "b" / segment_name(1)).write_bytes(b"")
    with pytest.raises(JournalError, match="damaged at byte"):
        LocalDataPlane(journal_dir=tmp_path / "b")


def test_compaction_bounds_the_journal_and_recovery_replays_only_what_follows(tmp_path) -> None:
    dp = LocalDataPlane(journal_dir=tmp_path, journal_sync="batch", journal_compact_records=7)
    _run(dp)
    names = sorted(os.listdir(tmp_path))
    assert "snapshot" in names
    segments = [n for n in names if n.startswith("journal-")]
    assert len(segments) == 1 and segments[0] != segment_name(0)
    _abandon(dp)
    again = LocalDataPlane(journal_dir=tmp_path)
    assert again.journal.recovered_records < 7
    _same(dp, again)
    again.close()
    dp.close()


def test_a_compaction_cut_short_by_a_crash_loses_nothing(tmp_path) -> None:
    """Killed after the cut, before the snapshot: the old segments are replayed. Killed after
    the snapshot, before the old segments went: they are stale and removed."""
    dp = LocalDataPlane(journal_dir=tmp_path / "a", journal_sync="always")
    ops = list(_ops(np.random.default_rng(3)))
    for op in ops[:8]:
        op(dp)
    with dp._lock:  # the first half of compact_journal, then the process dies
        dp.journal.cut()
    for op in ops[8:]:
        op(dp)
    _abandon(dp)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    again = LocalDataPlane(journal_dir=tmp_path / "a")
    _same(dp, again)
    # a snapshot at the cut, the segments before it left behind
    again.compact_journal()
    snapshot = tmp_path / "a" / "snapshot"
    shutil.copytree(snapshot, tmp_path / "b" / "snapshot")
    again.close()
    stale = tmp_path / "b" / segment_name(0)
    assert stale.exists()
    meta = (tmp_path / "b" / "snapshot" / "manifest.json").read_text()
    assert '"next_segment"' in meta
    # b: segments 0 and 1 plus a snapshot cut at 3 (the one again wrote): 0 and 1 are stale
    (tmp_path / "b" / segment_name(2)).write_bytes(b"")
    (tmp_path / "b" / segment_name(3)).write_bytes(b"")
    third = LocalDataPlane(journal_dir=tmp_path / "b")
    _same(dp, third)
    assert not stale.exists()
    third.close()
    dp.close()


def test_concurrent_writers_under_group_commit_all_come_back(tmp_path) -> None:
    dp = LocalDataPlane(journal_dir=tmp_path, journal_sync="batch")
    dp.register_partition("p", [])

    def write(t: int) -> None:
        for i in range(25):
            dp.put_samples(partition_id="p", sample_ids=[f"{t}/{i}"],
                           fields={"x": torch.full((1, 4), float(t * 100 + i))})

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    _abandon(dp)
    again = LocalDataPlane(journal_dir=tmp_path)
    assert len(again.list_sample_ids("p")) == 100
    _same(dp, again)
    again.close()
    dp.close()


def test_the_journal_is_the_owners_and_one_store_writes_it(tmp_path) -> None:
    root = tmp_path / "j"
    dp = LocalDataPlane(journal_dir=root, journal_sync="always")
    _run(dp)
    dp.compact_journal()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    with pytest.raises(JournalError, match="open in another store"):
        LocalDataPlane(journal_dir=root)
    dp.close()
    LocalDataPlane(journal_dir=root).close()  # closed: the lock is free


def test_bad_journal_input_is_refused_naming_it_and_nothing_is_written(tmp_path) -> None:
    with pytest.raises(ValueError, match="journal_sync must be one of"):
        LocalDataPlane(journal_dir=tmp_path / "x", journal_sync="sometimes")
    with pytest.raises(ValueError, match="journal_compact_records must be an int >= 1"):
        LocalDataPlane(journal_dir=tmp_path / "y", journal_compact_records=0)
    dp = LocalDataPlane(journal_dir=tmp_path / "z")
    dp.register_partition("p", [])
    size = (tmp_path / "z" / segment_name(0)).stat().st_size
    with pytest.raises(TypeError, match=r"tags\[0\].*tuple"):  # JSON would bring it back a list
        dp.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1)},
                       tags=[{"t": (1, 2)}])
    with pytest.raises(JournalError, match="cannot hold dtype"):
        dp.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1, dtype=torch.complex64)})
    assert dp.list_sample_ids("p") == []
    assert (tmp_path / "z" / segment_name(0)).stat().st_size == size
    dp.close()
    (tmp_path / "f").write_text("")
    with pytest.raises(JournalError, match="not a directory"):
        LocalDataPlane(journal_dir=tmp_path / "f")


def test_the_backend_config_builds_a_journaled_store_and_refuses_an_unknown_sync(tmp_path) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tq_plugin.config import BackendConfig, RayBackendConfig
    from tq_plugin.config.rules import ConfigError

    cfg = OmegaConf.structured(BackendConfig(journal_dir=str(tmp_path), journal_sync="batch"))
    dp = instantiate(cfg)
    assert dp.journal is not None and dp.journal.sync == "batch"
    dp.close()
    for schema in (BackendConfig, RayBackendConfig):
        with pytest.raises(ConfigError, match="tq.backend.journal_sync"):
            schema(journal_sync="sometimes")


def test_a_put_the_journal_failed_to_write_is_never_read_back(tmp_path, monkeypatch) -> None:
    """A journal write that fails (a full disk) fails the put and stops the store, reads
    included: the row landed in memory before its record, and a caller reading it back after
    the error (as the sink does after a failed put) would take it for acknowledged. Reopened
    from the journal, the store holds what was acknowledged and not the failed put."""
    from tq_plugin.data_plane.backends import _journal

    dp = LocalDataPlane(journal_dir=tmp_path, journal_sync="always")
    dp.register_partition(partition_id="p", fields=[])
    dp.put_samples(partition_id="p", sample_ids=["a"], fields={"x": torch.ones(1, 3)})

    def full_disk(fd, pieces):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_journal, "_writev_all", full_disk)
    with pytest.raises(JournalError, match="No space left"):
        dp.put_samples(partition_id="p", sample_ids=["b"], fields={"x": torch.zeros(1, 3)})
    for call in (lambda: dp.get_samples(partition_id="p", sample_ids=["b"], select_fields=["x"]),
                 lambda: dp.list_sample_ids("p")):
        with pytest.raises(JournalError, match="takes no more writes"):
            call()
    monkeypatch.undo()
    _abandon(dp)
    again = LocalDataPlane(journal_dir=tmp_path)
    assert again.list_sample_ids("p") == ["a"]
    again.close()
