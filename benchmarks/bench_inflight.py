"""In-flight weight updates: the disaggregated topology with and without
``recipe.inflight_updates``, on completions of widely varying length.

GRPO (16 prompts x 4 samples, 4 epochs a step), 2 rollout workers on ``tq/backend=ray``,
``recipe.max_staleness=1``, one torch thread per process. The pattern task's targets are
U(4, 64) symbols long (``task.min_len=4 task.max_len=64``, one turn) and a completion may run to
64 new tokens, so how long a chunk decodes varies with what the policy samples (the figures give
the completion lengths seen). Both kinds run the same seed and steps through ``RLRecipe`` in
this process, alternating (A, B, A, B, ...) so load from elsewhere falls on each alike; the table
shows medians (min-max) over the repeats:

* steps/s over steady state (the first microbatch of step 1 to the end of the fit);
* trainer idle: the share of that window the trainer waits for rows (``trainer_wait_s``);
* generated tokens/s: the completions' tokens of the window's steps per second of it;
* token staleness: each step's ``token_staleness_mean`` averaged and ``token_staleness_max``'s
  largest; the share of rows spanning two versions (``multi_version_fraction``, averaged).

Run: ``.venv/bin/python -m benchmarks.bench_inflight [--steps N] [--repeats R]``.
Goal (issue 36): >= 1.3x the steps/s without in-flight updates.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from typing import Any

from benchmarks._common import Stat, table
from benchmarks.bench_topology import timed_fit

BASE = ["recipe.topology=disaggregated", "tq/backend=ray", "recipe.rollout_workers=2",
        "recipe.max_staleness=1", "task.min_len=4", "task.max_len=64", "task.turns=1",
        "recipe.max_new_tokens=64", "model.max_seq_len=80"]
KINDS = {
    "without in-flight updates": [],
    "in-flight, kv keep": ["recipe.inflight_updates=true", "recipe.inflight.kv=keep"],
    "in-flight, kv recompute": ["recipe.inflight_updates=true", "recipe.inflight.kv=recompute"],
}


def run_once(kind: str, *, steps: int, seed: int) -> dict[str, float]:
    span, rows = timed_fit("grpo", [*BASE, *KINDS[kind], f"recipe.num_steps={steps}",
                                    f"recipe.seed={seed}"])
    per_step = 16 * 4  # the preset's prompts x samples
    lengths = [float(r["completions/mean_length"]) for r in rows]
    return {"steps_per_s": (steps - 1) / span,
            "idle": sum(float(r["trainer_wait_s"]) for r in rows) / span,
            "tokens_per_s": sum(lengths) * per_step / span,
            "mean_length": sum(lengths) / len(lengths),
            "max_length": max(float(r["completions/max_length"]) for r in rows),
            "token_staleness_mean": sum(float(r["token_staleness_mean"]) for r in rows) / len(rows),
            "token_staleness_max": max(int(r["token_staleness_max"]) for r in rows),
            "multi_version": sum(float(r["multi_version_fraction"]) for r in rows) / len(rows),
            "masked": sum(int(r["tokens_masked_stale"]) for r in rows)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    args = parser.parse_args(argv if argv is not None else [])
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    results: dict[str, list[dict[str, float]]] = {k: [] for k in args.kinds}
    loads = []
    for _ in range(args.repeats):
        for kind in args.kinds:
            loads.append(os.getloadavg()[0])
            results[kind].append(run_once(kind, steps=args.steps, seed=0))
            print(f"  {kind}: {results[kind][-1]}", flush=True)
    base = Stat.of([r["steps_per_s"] for r in results[args.kinds[0]]])
    rows, figures = [], {}
    for kind, runs in results.items():
        rate = Stat.of([r["steps_per_s"] for r in runs])
        ratio = f"{rate.median / base.median:.2f}x"
        rows.append([kind, rate.fmt(".3f"), ratio,
                     Stat.of([r["idle"] for r in runs]).fmt(".2f"),
                     Stat.of([r["tokens_per_s"] for r in runs]).fmt(".0f"),
                     Stat.of([r["mean_length"] for r in runs]).fmt(".1f"),
                     Stat.of([r["token_staleness_mean"] for r in runs]).fmt(".3f"),
                     max(r["token_staleness_max"] for r in runs),
                     Stat.of([r["multi_version"] for r in runs]).fmt(".3f"),
                     sum(r["masked"] for r in runs)])
        figures[f"inflight_ratio_{kind.replace(' ', '_').replace(',', '')}"] = ratio
    markdown = "\n\n".join([
        "## In-flight weight updates (`bench_inflight`)",
        (f"GRPO, 2 workers on `tq/backend=ray`, `recipe.max_staleness=1`, pattern targets "
         f"U(4, 64) symbols, up to 64 new tokens, one turn; {args.steps} steps, seed 0, "
         f"{args.repeats} alternating repeats (load average at the runs' starts: "
         f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores). Steps/s over steady "
         "state; trainer idle = share of it waiting for rows; tokens/s = generated tokens; "
         "token staleness = the steps' mean of `token_staleness_mean`, and the largest "
         "`token_staleness_max`; rows spanning two versions = the steps' mean "
         "`multi_version_fraction`. Goal: in-flight >= 1.3x the steps/s without."),
        table(["kind", "steps/s", "vs without", "trainer idle", "generated tokens/s",
               "mean completion", "token staleness mean", "max", "rows on 2 versions",
               "tokens masked"], rows),
    ])
    print(markdown)
    return {"markdown": markdown, "key_figures": {}, "results": results}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
