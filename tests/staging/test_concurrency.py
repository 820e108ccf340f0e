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
    verify_and_linearize,
)

from .conftest import TEXT_PARTITION, build_chain

THREADS = 8
ROLLOUTS_PER_THREAD = 12


def test_eight_threads_staging_at_once_lose_nothing(client) -> None:
    sink = TQTokenSink(client.inner, staging_partition=TEXT_PARTITION)
    start = threading.Barrier(THREADS)

    def worker(thread: int):
        start.wait()
        staged = []
        for k in range(ROLLOUTS_PER_THREAD):
            records = build_chain(
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
