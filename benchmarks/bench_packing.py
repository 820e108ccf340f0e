"""Padded-token fraction per packing mode, and planner time (not a test; run with `make bench`).

Standard length distribution: lengths uniform in 100..2000 (seed 0). For each mode the rows are
sharded with ``shard_meta_for_dp`` (so the figures include the microbatch-count equalization
across ranks) and the waste is measured on the plans the shards carry:

* no packing, every row padded to the step's pad target ``global_forward_pad_seqlen``
  (``round_up(max length, 64)``, minted on the whole meta);
* no packing, fixed microbatches of ``MBS`` rows, each padded to its own longest row (round 64);
* sequence packing: computed tokens = each bin's packed length (a varlen/THD forward), and, for
  fixed-shape bins, each bin padded to ``max_tokens_per_microbatch`` or to the longest bin of the
  step;
* dynamic batching: each microbatch an ``[n, round_up(max, 64)]`` rectangle.

Run: ``.venv/bin/python -m benchmarks.bench_packing``.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._common import median_seconds, table
from tq_plugin.data_plane.column_io import round_up, stamp_global_forward_pad_seqlen
from tq_plugin.data_plane.meta import KVBatchMeta
from tq_plugin.data_plane.microbatches import (
    padded_token_fraction,
)
from tq_plugin.data_plane.packing import (
    plan_dynamic_batches,
    plan_sequence_packing,
)
from tq_plugin.data_plane.schema import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    MICRO_BATCH_INDICES,
    MICRO_BATCH_LENGTHS,
)
from tq_plugin.data_plane.sharding import shard_meta_for_dp

ROWS = 1024
TIMING_ROWS = 4096
ROUND = 64
MBS = 8
REPEATS = 15


def standard_meta(n: int, seed: int = 0) -> KVBatchMeta:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 2001, (n,), generator=g).tolist()
    meta = KVBatchMeta("bench", "train", [f"s{i}" for i in range(n)], ["input_ids"], lengths)
    stamp_global_forward_pad_seqlen(meta, sequence_length_round=ROUND)
    return meta


def _modes() -> dict[str, dict[str, Any]]:
    modes: dict[str, dict[str, Any]] = {
        "no packing, pad to step target": {},
        f"no packing, {MBS}-row microbatches padded to their max": {"fixed_mbs": MBS},
    }
    for cap in (4096, 8192, 16384):
        for mult in (1, 8):
            args = {"sequence_length_pad_multiple": mult, "max_tokens_per_microbatch": cap}
            modes[f"sequence packing, {cap} tok, pad multiple {mult}"] = {
                "sequence_packing_args": args
            }
    for cap in (8192, 16384):
        args = {"sequence_length_round": ROUND, "max_tokens_per_microbatch": cap}
        modes[f"dynamic batching, {cap} tok, round {ROUND}"] = {"dynamic_batching_args": args}
    return modes


def _measure(meta: KVBatchMeta, dp_world: int, spec: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in spec.items() if k != "fixed_mbs"}
    shards, _ = shard_meta_for_dp(meta, dp_world=dp_world, **kwargs)
    real = computed = computed_fixed = 0
    rank_tokens, mb_counts, all_mbl = [], [], []
    for sh in shards:
        lens = sh.sequence_lengths
        real += sum(lens)
        if "sequence_packing_args" in spec:
            cap = spec["sequence_packing_args"]["max_tokens_per_microbatch"]
            mbl = sh.extra_info[MICRO_BATCH_LENGTHS][0]
            tokens = sum(mbl)
            computed_fixed += cap * len(mbl)
            all_mbl.extend(mbl)
        elif "dynamic_batching_args" in spec:
            mbl = sh.extra_info[MICRO_BATCH_LENGTHS][0]
            ranges = sh.extra_info[MICRO_BATCH_INDICES][0]
            tokens = sum(length * (e - s) for (s, e), length in zip(ranges, mbl))
        elif "fixed_mbs" in spec:
            mbl = [
                round_up(max(lens[s : s + MBS]), ROUND) * len(lens[s : s + MBS])
                for s in range(0, len(lens), MBS)
            ]
            tokens = sum(mbl)
        else:
            mbl = [0]
            tokens = meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] * len(lens)
        computed += tokens
        rank_tokens.append(tokens)
        mb_counts.append(len(mbl))
    out = {
        "padded_fraction": (computed - real) / computed,
        "microbatches_per_rank": mb_counts[0] if len(set(mb_counts)) == 1 else mb_counts,
        "rank_imbalance": max(rank_tokens) / (sum(rank_tokens) / len(rank_tokens)),
    }
    if "sequence_packing_args" in spec:
        out["padded_fraction_bins_to_capacity"] = (computed_fixed - real) / computed_fixed
        longest = max(all_mbl) * len(all_mbl)
        out["padded_fraction_bins_to_longest"] = (longest - real) / longest
    return out


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.2%}"


def main() -> dict[str, Any]:
    meta = standard_meta(ROWS)
    target = meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]
    waste: dict[str, dict[str, Any]] = {}
    rows = []
    for name, spec in _modes().items():
        for dp in (1, 8):
            r = _measure(meta, dp, spec)
            waste[f"{name}, DP {dp}"] = r
            rows.append(
                [
                    name,
                    dp,
                    _pct(r["padded_fraction"]),
                    _pct(r.get("padded_fraction_bins_to_capacity")),
                    _pct(r.get("padded_fraction_bins_to_longest")),
                    r["microbatches_per_rank"],
                    f"{r['rank_imbalance']:.3f}",
                ]
            )

    big = standard_meta(TIMING_ROWS, seed=1)
    lengths = torch.tensor(big.sequence_lengths)
    seq = {"sequence_length_pad_multiple": 8, "max_tokens_per_microbatch": 8192}
    dyn = {"sequence_length_round": ROUND, "max_tokens_per_microbatch": 16384}
    timings = {
        "plan_sequence_packing (8192 tok)": lambda: plan_sequence_packing(
            lengths, max_tokens_per_microbatch=8192, sequence_length_pad_multiple=8
        ),
        "plan_dynamic_batches (16384 tok)": lambda: plan_dynamic_batches(
            lengths, max_tokens_per_microbatch=16384, sequence_length_round=ROUND
        ),
        "shard_meta_for_dp, no packing, DP 8": lambda: shard_meta_for_dp(big, dp_world=8),
        "shard_meta_for_dp, sequence packing, DP 8": lambda: shard_meta_for_dp(
            big, dp_world=8, sequence_packing_args=seq
        ),
        "shard_meta_for_dp, dynamic batching, DP 8": lambda: shard_meta_for_dp(
            big, dp_world=8, dynamic_batching_args=dyn
        ),
        "padded_token_fraction (8192-tok plan)": lambda: padded_token_fraction(
            lengths, plan_sequence_packing(lengths, max_tokens_per_microbatch=8192), mode="packed"
        ),
    }
    planner_ms = {name: median_seconds(fn, runs=REPEATS) * 1e3 for name, fn in timings.items()}

    text = "\n\n".join(
        [
            "## Packing and DP sharding (`benchmarks/bench_packing.py`)",
            (f"Padded-token fraction, {ROWS} rows, lengths uniform in 100..2000 (seed 0), sharded "
            f"with `shard_meta_for_dp`; step pad target `global_forward_pad_seqlen` = {target}. "
            "'padded fraction' counts what each mode computes: every row at the pad target, "
            "each microbatch rectangle at its own padded max, or each packed bin at its packed "
            "length (varlen/THD forward); the two bin columns pad every packed bin to "
            "`max_tokens_per_microbatch` or to the step's longest bin (fixed-shape forward)."),
            table(
                [
                    "mode",
                    "DP",
                    "padded fraction",
                    "bins padded to capacity",
                    "bins padded to longest bin",
                    "microbatches/rank",
                    "rank tokens max/mean",
                ],
                rows,
            ),
            f"Planner time, {TIMING_ROWS} rows (median of {REPEATS}, ms):",
            table(["call", "ms"], [[k, f"{v:.1f}"] for k, v in planner_ms.items()]),
        ]
    )
    print(text)
    return {
        "markdown": text,
        "rows": ROWS,
        "pad_target": target,
        "waste": waste,
        "planner_ms": planner_ms,
    }


if __name__ == "__main__":
    main()
