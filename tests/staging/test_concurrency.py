"""Concurrent staging: many threads stage at once; every acknowledged row is fetchable and
verifies."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from tq_plugin.staging import (
    StagedCallBaseSnapshot,
    TQTokenSink,
    TQTokenSource,
    make_rollout_receipt,
    make_staged_chain,
    verify_and_linearize,
)

TEXT_PARTITION = "rollout_staging"

THREADS = 8
ROLLOUTS_PER_THREAD = 12


def test_eight_threads_staging_at_once_lose_nothing(client) -> None:
    sink = TQTokenSink(client.inner, staging_partition=TEXT_PARTITION)
    start = threading.Barrier(THREADS)

    def worker(thread: int):
        start.wait()
        staged = []
        for k in range(ROLLOUTS_PER_THREAD):
            records = make_staged_chain(
                f"t{thread}-r{k}",
                [([thread, k], [1000 + k], [-0.5]), ([7], [8, 9], [-0.25, -0.125])],
                extras=[{"thread": thread}, None],
            )
            results = [sink.stage(r) for r in records]
            staged.append((records, results))
        return staged

    with ThreadPoolExecutor(THREADS) as pool:
        outcomes = [item for part in pool.map(worker, range(THREADS)) for item in part]

    source = TQTokenSource(
        client.inner, staging_partition=TEXT_PARTITION, snapshot_cls=StagedCallBaseSnapshot
    )
    assert len(outcomes) == THREADS * ROLLOUTS_PER_THREAD
    all_keys = []
    for records, results in outcomes:
        assert all(r.ok for r in results)
        assert [r.staging_key for r in results] == [rec.staging_key for rec in records]
        all_keys += [r.staging_key for r in results]
    fetched = source.fetch_for_finalization(all_keys)
    by_key = {item.staging_key: item.snapshot for item in fetched}
    for records, _ in outcomes:
        snapshots = [by_key[r.staging_key] for r in records]
        row = verify_and_linearize(make_rollout_receipt(records), snapshots)
        assert row.token_ids[-3:] == [7, 8, 9]
    assert sorted(client.inner.list_sample_ids(partition_id=TEXT_PARTITION)) == sorted(all_keys)


class _BlockingClient:
    """Blocks the put of one key until released; every other put goes straight through."""

    def __init__(self, inner, blocked_key: str) -> None:
        self.inner, self.blocked_key = inner, blocked_key
        self.entered, self.release = threading.Event(), threading.Event()

    def put_samples(self, **kwargs):
        if kwargs["sample_ids"] == [self.blocked_key]:
            self.entered.set()
            assert self.release.wait(timeout=30)
        return self.inner.put_samples(**kwargs)


def test_a_slow_write_does_not_serialize_other_stages(client) -> None:
    (slow,) = make_staged_chain("slow", [([1], [2], [-0.5])])
    (fast,) = make_staged_chain("fast", [([1], [2], [-0.5])])
    blocking = _BlockingClient(client.inner, slow.staging_key)
    sink = TQTokenSink(blocking, staging_partition=TEXT_PARTITION)
    with ThreadPoolExecutor(2) as pool:
        pending = pool.submit(sink.stage, slow)
        assert blocking.entered.wait(timeout=30)
        assert sink.stage(fast).ok  # completes while the other write is still blocked
        assert not pending.done()
        blocking.release.set()
        assert pending.result(timeout=30).ok
