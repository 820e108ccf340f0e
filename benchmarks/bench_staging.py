"""Token staging throughput on the local backend.

* Digest: MB/s of column payload (8 B per token id plus 4 B per mask and logprob value) at 256
  and 8,192 tokens per call, for wire columns (int64 / float32 arrays), for validated records'
  lists (what the sink and snapshot validation hash) and for arbitrary Python lists (with the
  exact-type scan ``compute_staging_digest`` runs on them).
* ``stage()``: calls/s for 256-token deltas from 1 and 4 threads (records built beforehand, as an
  engine hands them over).
* Stage + fetch + verify: every call staged, read back in finalization batches of 64 calls
  (validated snapshots: the digest is recomputed over the fetched float32 values), and each
  rollout verified and linearized against its receipt (without hashing each call a second
  time, as ``RolloutReassembler`` does); calls/s over the whole pipeline,
  single-threaded, on LocalDataPlane and for the staging layer alone (no-op put, replayed
  reads), which separates this layer's cost from the backend's.
* ``fetch_for_finalization`` + verify alone: rows/s.

Run: ``python -m benchmarks.bench_staging`` (or ``make bench`` for every benchmark).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks._common import median_seconds, table
from tq_plugin.data_plane import LocalDataPlane
from tq_plugin.staging import (
    StagedCallBaseSnapshot,
    TQTokenSink,
    TQTokenSource,
    make_rollout_receipt,
    make_staged_chain,
    register_staging_partition,
    verify_and_linearize,
)
from tq_plugin.staging.digest import staging_digest_and_columns

DELTA = 256
CALLS_PER_ROLLOUT = 4
BATCH = 64


def rollout(rollout_id: str, rng: np.random.Generator, delta: int = DELTA) -> list:
    """A chain of calls whose deltas are ``delta`` tokens: 32 carried, the rest generated."""
    turns = [
        (
            rng.integers(0, 150_000, 32).tolist(),
            rng.integers(0, 150_000, delta - 32).tolist(),
            (-rng.random(delta - 32)).tolist(),
        )
        for _ in range(CALLS_PER_ROLLOUT)
    ]
    return make_staged_chain(rollout_id, turns, weight_versions=list(range(CALLS_PER_ROLLOUT)))


def _fresh() -> LocalDataPlane:
    dp = LocalDataPlane()
    register_staging_partition(dp, "staging")
    return dp


def digest_throughput(tokens: int) -> dict:
    """MB/s of column payload for the three input forms the digest meets."""
    rng = np.random.default_rng(0)
    record = rollout("d", rng, delta=tokens)[0]
    fields = record.model_dump(exclude={"digest", "extras"})
    wire = dict(
        fields,
        token_ids_delta=np.asarray(record.token_ids_delta, dtype=np.int64),
        token_mask_delta=np.asarray(record.token_mask_delta, dtype=np.float32),
        generation_log_probs_delta=np.asarray(record.generation_log_probs_delta, dtype=np.float32),
    )
    payload = tokens * (8 + 4 + 4)
    reps = max(1, 2_000_000 // payload)
    forms = {
        "wire": wire,  # what a reader re-hashes: int64 / float32 columns
        "records": {**fields, "check_types": False},  # validated records (sink, snapshots)
        "lists": fields,  # arbitrary Python lists: exact-type scan included
    }
    out = {"tokens": tokens}
    for name, kwargs in forms.items():

        def run(kw: dict = kwargs) -> None:
            for _ in range(reps):
                staging_digest_and_columns(**kw)

        out[f"{name}_mb_s"] = payload * reps / median_seconds(run, runs=5, warmup=1) / 1e6
    return out


class _NoStore:
    """A client that acknowledges every put without storing it: isolates the sink's own cost."""

    def put_samples(self, **kwargs: object) -> None:
        return None


def stage_calls_per_s(threads: int, rollouts: int = 150, *, store: bool = True) -> float:
    rng = np.random.default_rng(1)
    work = [rollout(f"r{i}", rng) for i in range(rollouts)]
    per_thread = [work[t::threads] for t in range(threads)]

    def once() -> None:
        sink = TQTokenSink(_fresh() if store else _NoStore(), staging_partition="staging")

        def stage_all(chunk: list) -> None:
            for records in chunk:
                for record in records:
                    if not sink.stage(record).ok:
                        raise RuntimeError("stage failed in the benchmark")

        if threads == 1:
            stage_all(work)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(stage_all, per_thread))

    seconds = median_seconds(once, runs=3, warmup=1)
    return rollouts * CALLS_PER_ROLLOUT / seconds


def _finalize(source: TQTokenSource, receipts: list) -> None:
    """Finalization batches of BATCH calls: one fetch each, then verify + linearize per rollout."""
    per_batch = BATCH // CALLS_PER_ROLLOUT
    for start in range(0, len(receipts), per_batch):
        group = receipts[start : start + per_batch]
        fetched = source.fetch_for_finalization(
            [row.staging_key for r in group for row in r.manifest]
        )
        for k, receipt in enumerate(group):
            calls = fetched[k * CALLS_PER_ROLLOUT : (k + 1) * CALLS_PER_ROLLOUT]
            verify_and_linearize(receipt, [c.snapshot for c in calls], recompute_digests=False)


def pipeline(rollouts: int = 150) -> dict:
    """End to end on LocalDataPlane: stage every call, then finalize in batches."""
    rng = np.random.default_rng(2)
    work = [rollout(f"r{i}", rng) for i in range(rollouts)]
    receipts = [make_rollout_receipt(records) for records in work]
    timings: dict[str, list[float]] = {"stage": [], "finalize": []}

    def once() -> None:
        dp = _fresh()
        sink = TQTokenSink(dp, staging_partition="staging")
        source = TQTokenSource(dp, staging_partition="staging", snapshot_cls=StagedCallBaseSnapshot)
        t0 = time.perf_counter()
        for records in work:
            for record in records:
                sink.stage(record)
        t1 = time.perf_counter()
        _finalize(source, receipts)
        timings["stage"].append(t1 - t0)
        timings["finalize"].append(time.perf_counter() - t1)

    total = median_seconds(once, runs=3, warmup=1)
    calls = rollouts * CALLS_PER_ROLLOUT
    return {
        "pipeline_calls_s": calls / total,
        "finalize_rows_s": calls / float(np.median(timings["finalize"])),
    }


def layer_only(rollouts: int = 150) -> dict:
    """The staging layer's own cost: stage against a no-op store, finalize from prefetched reads.

    Every read the finalizer would issue is made once beforehand and replayed, so the figure
    is the sink's encoding + digest, the source's decoding + snapshot validation, and the
    verifier, without the backend's put/get time.
    """
    rng = np.random.default_rng(3)
    work = [rollout(f"r{i}", rng) for i in range(rollouts)]
    receipts = [make_rollout_receipt(records) for records in work]
    dp = _fresh()
    real_sink = TQTokenSink(dp, staging_partition="staging")
    for records in work:
        for record in records:
            real_sink.stage(record)
    source = TQTokenSource(dp, staging_partition="staging", snapshot_cls=StagedCallBaseSnapshot)
    reads: dict[tuple[str, ...], object] = {}
    fetch = source.store.get

    def replay(keys: list, *, select_fields: list) -> object:
        key = tuple(keys)
        if key not in reads:
            reads[key] = fetch(keys, select_fields=select_fields)
        return reads[key]

    source.store.get = replay  # type: ignore[method-assign]
    _finalize(source, receipts)
    sink = TQTokenSink(_NoStore(), staging_partition="staging")

    def once() -> None:
        for records in work:
            for record in records:
                sink.stage(record)
        _finalize(source, receipts)

    seconds = median_seconds(once, runs=5, warmup=1)
    return {"layer_calls_s": rollouts * CALLS_PER_ROLLOUT / seconds}


def main() -> dict:
    digests = [digest_throughput(n) for n in (DELTA, 8192)]
    stage = {threads: stage_calls_per_s(threads) for threads in (1, 4)}
    stage_no_store = stage_calls_per_s(1, store=False)
    pipe = pipeline()
    layer = layer_only()
    md = "\n".join(
        [
            "### Token staging",
            "",
            table(
                [
                    "tokens per call",
                    "digest MB/s: wire int64/float32 columns",
                    "validated record lists",
                    "unvalidated Python lists",
                ],
                [
                    [d["tokens"], d["wire_mb_s"], d["records_mb_s"], d["lists_mb_s"]]
                    for d in digests
                ],
            ),
            "",
            table(
                ["measure", "calls (rows) / s", "target"],
                [
                    [f"stage(), {DELTA}-token deltas, 1 thread, LocalDataPlane", stage[1], ""],
                    [f"stage(), {DELTA}-token deltas, 4 threads, LocalDataPlane", stage[4], ""],
                    ["stage(), 1 thread, no-op store (the sink's own cost)", stage_no_store, ""],
                    [
                        f"fetch_for_finalization + verify, {BATCH}-call batches, LocalDataPlane",
                        pipe["finalize_rows_s"],
                        "",
                    ],
                    [
                        "stage + fetch + verify, 1 thread, LocalDataPlane",
                        pipe["pipeline_calls_s"],
                        "≥ 5,000",
                    ],
                    [
                        "stage + fetch + verify, 1 thread, staging layer alone",
                        layer["layer_calls_s"],
                        "≥ 5,000",
                    ],
                ],
            ),
            "",
            (
                "Digest payload counts 16 B per token (u64 id, f32 mask, f32 logprob); target "
                f'≥ 200 MB/s. Rollouts are chains of {CALLS_PER_ROLLOUT} calls; "verify" is the '
                "snapshot validation at fetch (digest recomputed over the fetched float32 values) "
                "plus `verify_and_linearize` per rollout (lineage, chain and cumulative hashes; "
                "each digest is recomputed once, at fetch, as the reassembler does). "
                '"Staging layer alone" replaces the '
                "store's put with a no-op and replays prefetched reads, so it is the sink, source "
                "and verifier without the backend."
            ),
        ]
    )
    print(md)
    return {
        "markdown": md,
        "digest": digests,
        "stage_calls_s": stage,
        "stage_no_store_calls_s": stage_no_store,
        "pipeline": pipe,
        "layer": layer,
    }


if __name__ == "__main__":
    main()
