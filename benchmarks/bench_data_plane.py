"""Put+get bandwidth of the embedded data plane against a plain copy of the same bytes.

The standard rollout batch: N rows, ``input_ids`` jagged int64 and ``generation_logprobs``
jagged float32 with lengths uniform in 100..2000, ``reward`` float32 per row. Each timed
iteration puts the batch, reads every row back in put order and (separately timed) in a
shuffled order, then clears it. The copy baseline clones the same three buffers in the same run.
A naive row-dict store (one tensor per row and field) is measured alongside for context.

Run: ``python -m benchmarks.bench_data_plane`` (or ``make bench`` for every benchmark).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

from benchmarks._common import median_seconds, table
from tq_plugin.data_plane import LocalDataPlane, nested_from_lengths

FIELDS = ["input_ids", "generation_logprobs", "reward"]


def rollout_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 2001, (n,), generator=g)
    total = int(lengths.sum())
    return {
        "input_ids": nested_from_lengths(torch.randint(0, 32_000, (total,), generator=g), lengths),
        "generation_logprobs": nested_from_lengths(torch.rand(total, generator=g).neg_(), lengths),
        "reward": torch.randn(n, generator=g),
    }


def payload_bytes(batch: dict[str, torch.Tensor]) -> int:
    out = 0
    for v in batch.values():
        buf = v.values() if v.is_nested else v
        out += buf.numel() * buf.element_size()
    return out


class RowDictStore:
    """The naive design for comparison: a dict of per-row tensors, rebuilt on every read."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def put(self, ids: list[str], batch: dict[str, torch.Tensor]) -> None:
        cols = {k: (v.unbind() if v.is_nested else v) for k, v in batch.items()}
        for i, sid in enumerate(ids):
            self.rows[sid] = {k: c[i].clone() for k, c in cols.items()}

    def get(self, ids: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in FIELDS:
            rows = [self.rows[s][k] for s in ids]
            out[k] = (
                torch.nested.nested_tensor(rows, layout=torch.jagged)
                if rows[0].dim()
                else torch.stack(rows)
            )
        return out

    def clear(self, ids: list[str]) -> None:
        for s in ids:
            del self.rows[s]


def measure(n: int, runs: int = 7) -> dict[str, float]:
    batch = rollout_batch(n)
    nbytes = payload_bytes(batch)
    ids = [f"uid{i}_g0" for i in range(n)]
    shuffled = [ids[i] for i in torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    buffers = [v.values() if v.is_nested else v for v in batch.values()]
    dp = LocalDataPlane()
    dp.register_partition("train", FIELDS)

    def copy() -> list[torch.Tensor]:
        # Outputs stay alive together, as a read's columns do.
        return [b.clone() for b in buffers]

    def put_get() -> None:
        dp.put_samples(ids, "train", batch)
        dp.get_samples(ids, "train", FIELDS)
        dp.clear_samples(ids, "train")

    def put_get_shuffled() -> None:
        dp.put_samples(ids, "train", batch)
        dp.get_samples(shuffled, "train", FIELDS)
        dp.clear_samples(ids, "train")

    def put_only() -> None:
        dp.put_samples(ids, "train", batch)
        dp.clear_samples(ids, "train")

    rowdict = RowDictStore()

    def rowdict_put_get() -> None:
        rowdict.put(ids, batch)
        rowdict.get(ids)
        rowdict.clear(ids)

    t_copy = median_seconds(copy, runs=runs)
    t_pg = median_seconds(put_get, runs=runs)
    t_copy2 = median_seconds(copy, runs=runs)  # bracket the store timing: the box may be busy
    t_pg_shuf = median_seconds(put_get_shuffled, runs=runs)
    t_put = median_seconds(put_only, runs=runs)
    t_row = median_seconds(rowdict_put_get, runs=max(3, runs // 2), warmup=1)
    t_copy = min(t_copy, t_copy2)
    mb = nbytes / 1e6
    return {
        "rows": n,
        "payload_mb": mb,
        "copy_mb_s": mb / t_copy,
        "put_get_mb_s": mb / t_pg,
        "put_get_shuffled_mb_s": mb / t_pg_shuf,
        "put_ms": t_put * 1e3,
        "put_get_ms": t_pg * 1e3,
        "ratio": t_copy / t_pg,
        "ratio_shuffled": t_copy / t_pg_shuf,
        "rowdict_ratio": t_copy / t_row,
    }


def _rss_child(n: int) -> None:
    """Peak RSS growth of a put/get/clear loop, over the RSS before the batch existed."""

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    dp = LocalDataPlane()
    dp.register_partition("train", FIELDS)
    warm = rollout_batch(8)
    dp.put_samples([str(i) for i in range(8)], "train", warm)
    dp.get_samples([str(i) for i in range(8)], "train", FIELDS)
    dp.clear_samples(None, "train")
    dp.register_partition("train", FIELDS)
    before = rss()
    batch = rollout_batch(n)
    ids = [f"uid{i}" for i in range(n)]
    for _ in range(5):
        dp.put_samples(ids, "train", batch)
        out = dp.get_samples(ids, "train", FIELDS)
        del out
        dp.clear_samples(ids, "train")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"payload": payload_bytes(batch), "growth": peak - before}))


def peak_rss_ratio(n: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", f"from benchmarks.bench_data_plane import _rss_child; _rss_child({n})"],
        capture_output=True, text=True, check=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rows": n, "payload_mb": res["payload"] / 1e6, "peak_rss_growth_mb": res["growth"] / 1e6,
            "ratio": res["growth"] / res["payload"]}


def main(sizes: tuple[int, ...] = (64, 256, 1024, 4096)) -> dict:
    results = [measure(n) for n in sizes]
    rss = peak_rss_ratio(max(sizes))
    md = [
        "### Data plane: put + get vs a plain copy of the same bytes (LocalDataPlane)",
        "",
        table(
            ["rows", "payload MB", "copy MB/s", "put+get MB/s", "put+get / copy",
             "shuffled get: put+get / copy", "put ms", "put+get ms", "row-dict store / copy"],
            [[r["rows"], r["payload_mb"], r["copy_mb_s"], r["put_get_mb_s"], f"{r['ratio']:.0%}",
              f"{r['ratio_shuffled']:.0%}", r["put_ms"], r["put_get_ms"], f"{r['rowdict_ratio']:.0%}"]
             for r in results],
        ),
        "",
        f"Peak RSS growth of a put/get/clear loop at {rss['rows']} rows: "
        f"{rss['peak_rss_growth_mb']:.0f} MB for a {rss['payload_mb']:.0f} MB payload "
        f"(**{rss['ratio']:.2f}x**, counting the caller's batch, the store and the read).",
    ]
    text = "\n".join(md)
    print(text)
    return {"markdown": text, "results": results, "rss": rss}


if __name__ == "__main__":
    main()
