"""The buffer pool behind the embedded store: a step's put reuses what the previous step's clear
freed (no fresh pages to fault in), however long the step took; memory goes back to the OS only
once the pool is idle, or at once past its bound."""

from __future__ import annotations

import resource
import threading
import time

import pytest
import torch

from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths
from tq_plugin.data_plane.backends import _columns
from tq_plugin.data_plane.backends._columns import POOL

ROWS = 64
ROW_LEN = 32_768  # int64: 256 KiB a row, 16 MiB a batch (4,096 pages)


def _batch(value: int = 1) -> dict[str, torch.Tensor]:
    lengths = torch.full((ROWS,), ROW_LEN)
    return {"x": nested_from_lengths(torch.full((ROWS * ROW_LEN,), value, dtype=torch.int64), lengths)}


def _ids(prefix: str = "s") -> list[str]:
    return [f"{prefix}{i}" for i in range(ROWS)]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _small_pages() -> bool:
    """Whether fresh anonymous maps fault in 4 KiB at a time (transparent huge pages not
    ``always``), so a fresh 16 MiB buffer takes thousands of faults."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" not in f.read()
    except OSError:
        return True


def _step(dp: LocalDataPlane, pid: str = "train", value: int = 1) -> tuple[int, int]:
    """One step's cycle: register, put, read, clear. Returns the values buffer's address and the
    minor page faults the put took."""
    dp.register_partition(pid, ["x"])
    batch = _batch(value)
    faults = _minor_faults()
    dp.put_samples(partition_id=pid, sample_ids=_ids(), fields=batch)
    faults = _minor_faults() - faults
    address = dp._partitions[pid].columns["x"].values.data_ptr()
    out = dp.get_samples(partition_id=pid, sample_ids=_ids(), select_fields=["x"])
    assert torch.equal(out["x"].values(), batch["x"].values())
    del out
    dp.clear_samples(partition_id=pid, sample_ids=_ids())
    return address, faults


@pytest.fixture
def pool(monkeypatch):
    POOL.clear()
    monkeypatch.setattr(POOL, "idle_s", 30.0)
    monkeypatch.setattr(POOL, "limit_bytes", 256 << 20)
    yield POOL
    POOL.clear()


class _Clock:
    """``time`` for ``_columns``, with a settable offset on ``monotonic`` (the step's length)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def test_a_steps_put_reuses_the_buffer_the_last_clear_freed_however_long_the_step(pool, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(_columns, "time", clock)
    dp = LocalDataPlane()
    first, _ = _step(dp, value=1)
    assert pool.nbytes >= ROWS * ROW_LEN * 8  # freed into the pool, not unmapped
    clock.offset += 20.0  # a long step (generation, training) between two puts
    second, faults = _step(dp, value=2)
    assert second == first  # the same memory, already faulted in
    assert faults < 512, f"a put into a reused buffer took {faults} page faults"
    dp.trim()  # what happens without the pool: every put faults its pages in again
    _, cold = _step(dp, value=3)
    assert cold > 2_000 or not _small_pages(), cold
    dp.close()


def test_the_whole_partitions_clear_frees_into_the_pool_too(pool):
    dp = LocalDataPlane()
    dp.register_partition("train", ["x"])
    dp.put_samples(partition_id="train", sample_ids=_ids(), fields=_batch())
    address = dp._partitions["train"].columns["x"].values.data_ptr()
    dp.clear_samples(partition_id="train", sample_ids=None)
    assert pool.nbytes >= ROWS * ROW_LEN * 8
    again, _ = _step(dp)
    assert again == address
    dp.close()


def test_an_idle_pool_hands_its_buffers_back_to_the_os(pool, monkeypatch):
    monkeypatch.setattr(pool, "idle_s", 0.2)
    released = pool.released
    dp = LocalDataPlane()
    _step(dp)
    assert pool.nbytes > 0
    deadline = time.monotonic() + 10.0
    while pool.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.nbytes == 0 and pool.released > released
    # the next put starts from fresh pages, and the pool works as before
    _, faults = _step(dp)
    assert faults > 2_000 or not _small_pages(), faults
    assert pool.nbytes > 0
    dp.close()
    assert pool.nbytes == 0


class _StoppedClock:
    """``time`` for ``_columns`` that moves only when the test moves it; ``read`` is set each time
    the pool's reaper thread reads it (one check of whether the pool has been idle long enough)."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.read = threading.Event()

    def monotonic(self) -> float:
        if threading.current_thread().name == "tq-buffer-pool":
            self.read.set()
        return self.now

    def advance(self, seconds: float, pool) -> None:
        """Move on ``seconds`` and return once the reaper has checked the pool at that time."""
        self.now += seconds
        self.read.clear()
        with pool._wake:
            pool._wake.notify_all()
        assert self.read.wait(30)


def test_a_pool_in_use_is_not_idle(pool, monkeypatch):
    """Steps closer together than ``idle_s`` keep their buffers, whatever the total time."""
    clock = _StoppedClock()
    monkeypatch.setattr(_columns, "time", clock)
    monkeypatch.setattr(pool, "idle_s", 0.5)
    dp = LocalDataPlane()
    address, _ = _step(dp)
    for _ in range(6):  # 6 x 0.4 s: longer than idle_s in all, never idle that long
        clock.advance(0.4, pool)
        assert pool.nbytes > 0
        again, _ = _step(dp)
        assert again == address
    clock.advance(0.5, pool)  # now idle that long: the same reaper hands the buffers back
    assert pool.nbytes == 0
    dp.close()


def test_past_its_bound_the_pool_hands_the_oldest_buffers_back_at_once(pool, monkeypatch):
    size = ROWS * ROW_LEN * 8
    monkeypatch.setattr(pool, "limit_bytes", size + size // 2)  # room for one batch, not two
    released = pool.released
    dp = LocalDataPlane()
    for pid in ("a", "b"):
        dp.register_partition(pid, ["x"])
        dp.put_samples(partition_id=pid, sample_ids=_ids(), fields=_batch())
    newest = dp._partitions["b"].columns["x"].values.data_ptr()
    dp.clear_samples(partition_id="a", sample_ids=_ids())
    dp.clear_samples(partition_id="b", sample_ids=_ids())
    assert pool.nbytes == size and pool.released == released + 1  # "a"'s went back
    address, _ = _step(dp, pid="c")
    assert address == newest
    dp.close()


def test_a_buffer_a_read_still_holds_is_never_handed_out(pool):
    dp = LocalDataPlane()
    dp.register_partition("train", ["x"])
    dp.put_samples(partition_id="train", sample_ids=_ids(), fields=_batch(7))
    read = dp.get_samples(partition_id="train", sample_ids=_ids(), select_fields=["x"])
    held = read["x"].values()  # a view of the store's buffer
    dp.clear_samples(partition_id="train", sample_ids=_ids())
    dp.register_partition("train", ["x"])
    dp.put_samples(partition_id="train", sample_ids=_ids(), fields=_batch(9))
    assert bool((held == 7).all())  # the held buffer was not reused
    assert dp._partitions["train"].columns["x"].values.data_ptr() != held.data_ptr()
    dp.close()
