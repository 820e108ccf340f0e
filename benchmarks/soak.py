"""Staging soak: threads stage, finalize and clear many calls against one embedded store.

Shared by the slow-tier test (``tests/soak``, which asserts the memory rules) and ``make bench``
(which records throughput and stage latency). Each thread loops over rollouts of
``CALLS_PER_ROLLOUT`` staged calls: stage every call through ``TQTokenSink``, finalize groups of
``GROUP`` rollouts through ``RolloutReassembler(clear_staged=True)``, verify the training rows,
then clear them.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    RolloutReassembler,
    TQTokenSink,
    make_rollout_receipt,
    make_staged_chain,
    register_staging_partition,
)

STAGING, TRAIN = "soak_staging", "soak_train"
CALLS_PER_ROLLOUT = 4
GROUP = 4


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _turns(rng: random.Random) -> list[tuple[list[int], list[int], list[float]]]:
    turns = []
    for _ in range(CALLS_PER_ROLLOUT):
        carry = [rng.randrange(50_000) for _ in range(rng.randint(1, 32))]
        n = rng.randint(8, 96)
        turns.append((carry, [rng.randrange(50_000) for _ in range(n)], [-0.5] * n))
    return turns


def _worker(dp: LocalDataPlane, thread: int, rollouts: int, latencies: list[float],
            peak: list[int], barrier: threading.Barrier) -> int:
    sink = TQTokenSink(dp, staging_partition=STAGING)
    reassembler = RolloutReassembler(dp, staging_partition=STAGING, clear_staged=True)
    rng = random.Random(thread)
    barrier.wait()
    staged = 0
    receipts: list[Any] = []
    for r in range(rollouts):
        records = make_staged_chain(f"t{thread}-r{r}", _turns(rng))
        for rec in records:
            t0 = time.perf_counter()
            result = sink.stage(rec)
            latencies.append(time.perf_counter() - t0)
            if not result.ok:
                raise AssertionError(f"stage failed: {result.error}")
            staged += 1
        receipts.append(make_rollout_receipt(records))
        if len(receipts) == GROUP or r == rollouts - 1:
            meta = reassembler.finalize_group(receipts, partition_id=TRAIN)
            bad = [t for t in meta.tags if t.get("staging_status") != "ok"]
            if bad:
                raise AssertionError(f"finalize produced placeholders: {bad[:2]}")
            if thread == 0:
                peak[0] = max(peak[0], dp.stats()["bytes_held"])
            dp.clear_samples(partition_id=TRAIN, sample_ids=meta.sample_ids)
            receipts = []
    return staged


def run_soak(threads: int = 8, calls: int = 100_000) -> dict[str, float]:
    """Stage ``calls`` calls over ``threads`` threads; figures and memory readings."""
    dp = LocalDataPlane()
    register_staging_partition(dp, STAGING)
    dp.register_partition(TRAIN, [])
    rollouts = max(1, calls // (threads * CALLS_PER_ROLLOUT))

    def round_(n_rollouts: int) -> tuple[int, list[float], int, float]:
        barrier = threading.Barrier(threads)
        lat: list[list[float]] = [[] for _ in range(threads)]
        peak = [0]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(lambda t: _worker(dp, t, n_rollouts, lat[t], peak, barrier),
                                 range(threads)))
        return sum(done), [x for part in lat for x in part], peak[0], time.perf_counter() - t0

    round_(8)  # warm-up: imports, allocator pools, torch's first-call caches
    gc.collect()
    rss_start = rss_bytes()
    staged, latencies, peak_held, seconds = round_(rollouts)
    rss_peak = rss_bytes()
    gc.collect()
    stats = dp.stats()
    rss_end = rss_bytes()
    lat = np.array(latencies)
    return {
        "threads": threads,
        "calls": staged,
        "seconds": seconds,
        "calls_per_s": staged / seconds,
        "p50_us": float(np.percentile(lat, 50) * 1e6),
        "p99_us": float(np.percentile(lat, 99) * 1e6),
        "rss_start_mb": rss_start / 1e6,
        "rss_peak_mb": rss_peak / 1e6,
        "rss_end_mb": rss_end / 1e6,
        "rows_left": stats["rows"],
        "bytes_held_end": stats["bytes_held"],
        "bytes_held_peak": max(peak_held, stats["peak_bytes_held"]),
    }


def main() -> dict[str, Any]:
    r = run_soak()
    markdown = "\n".join([
        "## Staging soak (8 threads, embedded store)",
        "",
        (f"{r['calls']:,} calls staged, finalized in groups of {GROUP} rollouts and cleared, "
        f"{r['threads']} threads (`python -m benchmarks.run_all soak`). Absolute figures: "
        "box-dependent."),
        "",
        "| calls/s | stage p50 | stage p99 | RSS start → peak → end | bytes held: peak → end |",
        "| --- | --- | --- | --- | --- |",
        (f"| {r['calls_per_s']:,.0f} | {r['p50_us']:.0f} µs | {r['p99_us']:.0f} µs | "
        f"{r['rss_start_mb']:.0f} → {r['rss_peak_mb']:.0f} → {r['rss_end_mb']:.0f} MB | "
        f"{r['bytes_held_peak'] / 1e6:.1f} MB → {r['bytes_held_end'] / 1e6:.3f} MB |"),
    ])
    print(markdown)
    return {"markdown": markdown, **r}


if __name__ == "__main__":
    main()
