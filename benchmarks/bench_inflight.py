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

Learning parity (``--parity-seeds``, 5 by default; ``--arms parity`` runs it alone): the GRPO
preset (pattern task, ``engine=native``, 120 steps) colocated; disaggregated (2 workers on Ray,
``recipe.max_staleness=1``, the default per-token truncated IS correction over each token's own
behaviour logprob) without in-flight updates; and with them, the KV cache kept and recomputed;
the seeds interleaved across the arms (seed 0: every arm; seed 1: ...). The figure is each run's
mean reward over its last 20 steps, averaged over the seeds; in-flight against colocated (goal
>= 95%), against the disaggregated topology without them, and keep against recompute; each
in-flight arm's fresh tokens' logprob gap (``fresh_logprob_gap``: 0 where the weights that
sampled a token scored its whole context, what a kept cache changed otherwise).

Run: ``.venv/bin/python -m benchmarks.bench_inflight [--steps N] [--repeats R] [--arms speed parity]``;
more parity runs to pool with the section's: ``--arms parity --parity-first-seed 5
--parity-seeds 10 --parity-arms "in-flight, kv keep" ...`` (a plain table of the runs).
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

TASK = ["task.min_len=4", "task.max_len=64", "task.turns=1", "recipe.max_new_tokens=64",
        "model.max_seq_len=80"]
SPLIT = ["recipe.topology=disaggregated", "tq/backend=ray", "recipe.rollout_workers=2",
         "recipe.max_staleness=1"]
KINDS = {
    "without in-flight updates": SPLIT,
    "in-flight, kv keep": [*SPLIT, "recipe.inflight_updates=true", "recipe.inflight.kv=keep"],
    "in-flight, kv recompute": [*SPLIT, "recipe.inflight_updates=true",
                                "recipe.inflight.kv=recompute"],
    # the same task in one process (its trainer generates: "idle" is its rollout time)
    "colocated": [],
}


def run_once(kind: str, *, steps: int, seed: int) -> dict[str, float]:
    span, rows = timed_fit("grpo", [*TASK, *KINDS[kind], f"recipe.num_steps={steps}",
                                    f"recipe.seed={seed}"])
    per_step = 16 * 4  # the preset's prompts x samples
    lengths = [float(r["completions/mean_length"]) for r in rows]
    idle_key = "rollout_s" if kind == "colocated" else "trainer_wait_s"

    def col(key: str) -> list[float]:  # a colocated run has no ledger columns: its tokens are fresh
        return [float(r.get(key) or 0) for r in rows]
    return {"steps_per_s": (steps - 1) / span,
            "idle": sum(col(idle_key)) / span,
            "tokens_per_s": sum(lengths) * per_step / span,
            "mean_length": sum(lengths) / len(lengths),
            "max_length": max(float(r["completions/max_length"]) for r in rows),
            "token_staleness_mean": sum(col("token_staleness_mean")) / len(rows),
            "token_staleness_max": int(max(col("token_staleness_max"))),
            "multi_version": sum(col("multi_version_fraction")) / len(rows),
            "masked": int(sum(col("tokens_masked_stale")))}


# Learning parity: the GRPO preset as it is (8 new tokens a turn, 2 turns), colocated and with
# in-flight updates; the last LAST steps' mean reward is a run's figure.
DISAGGREGATED = ["recipe.topology=disaggregated", "tq/backend=ray", "recipe.rollout_workers=2",
                 "recipe.max_staleness=1", "recipe.inflight_updates=true"]
ARMS = {
    "colocated": [],
    # the disaggregated topology as it runs without the feature: what in-flight updates change
    "disaggregated, no in-flight": DISAGGREGATED[:-1],
    "in-flight, kv keep": [*DISAGGREGATED, "recipe.inflight.kv=keep"],
    "in-flight, kv recompute": [*DISAGGREGATED, "recipe.inflight.kv=recompute"],
}
LAST = 20
PARITY_GAP = ("in-flight, kv keep", "in-flight, kv recompute")  # arms with a per-token ledger
PARITY_FIGURE = {"disaggregated, no in-flight": "parity_disaggregated",
                 "in-flight, kv keep": "parity_keep", "in-flight, kv recompute": "parity_recompute"}


def parity_run(arm: str, *, steps: int, seed: int) -> dict[str, float]:
    """One run of ``arm``: the mean reward of its last ``LAST`` steps, its ledger figures."""
    _, rows = timed_fit("grpo", [*ARMS[arm], f"recipe.num_steps={steps}", f"recipe.seed={seed}"])
    ledger = [r for r in rows if r.get("multi_version_fraction")]
    staleness = [float(r["token_staleness_mean"]) for r in rows if r.get("token_staleness_mean")]
    # The fresh tokens (the trainer's own version) against the step's no-grad pass: 0 when the
    # weights that sampled them are the trainer's throughout (ledger_gap); kv=keep's after a load
    # saw the old weights' cache.
    fresh = [(float(r["fresh_tokens"]), float(r["fresh_logprob_gap_mean"]),
              float(r["fresh_logprob_gap"])) for r in rows if r.get("fresh_tokens")]
    tokens = sum(n for n, _, _ in fresh)
    return {"reward_last": sum(float(r["reward"]) for r in rows[-LAST:]) / LAST,
            "fresh_gap_mean": sum(n * g for n, g, _ in fresh) / tokens if tokens else 0.0,
            "fresh_gap_max": max((g for _, _, g in fresh), default=0.0),
            "staleness": sum(staleness) / len(staleness) if staleness else 0.0,
            "multi_version": (sum(float(r["multi_version_fraction"]) for r in ledger) / len(ledger)
                              if ledger else 0.0),
            "masked": sum(int(r["tokens_masked_stale"]) for r in ledger)}


def parity(*, seeds: int, steps: int, first_seed: int = 0, arms: list[str] | None = None
           ) -> tuple[str, dict[str, str], dict[str, list[dict]]]:
    """The learning-parity section, its key figures and the runs (module docstring).
    ``first_seed``, ``arms`` (some of ``ARMS``): more runs to pool with a section's; unless every
    arm runs, the markdown is a plain table of the runs (no shares of colocated)."""
    arms = list(ARMS) if arms is None else arms
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    loads = []
    for seed in range(first_seed, first_seed + seeds):
        for arm in arms:  # interleaved: each seed runs every arm before the next seed
            loads.append(os.getloadavg()[0])
            runs[arm].append(parity_run(arm, steps=steps, seed=seed))
            print(f"  parity seed {seed} {arm}: {runs[arm][-1]}", flush=True)
    if set(arms) != set(ARMS) or first_seed:
        rows = [[arm, f"{sum(r['reward_last'] for r in rs) / len(rs):.3f}",
                 " / ".join(f"{r['reward_last']:.3f}" for r in rs)] for arm, rs in runs.items()]
        markdown = "\n\n".join([
            (f"Parity runs, seeds {first_seed}-{first_seed + seeds - 1}, {steps} steps (load "
             f"average at the runs' starts: {min(loads):.1f}-{max(loads):.1f}):"),
            table(["arm", f"reward, last {LAST} steps", "per seed"], rows)])
        return markdown, {}, runs
    markdown, figures = parity_section(runs, steps=steps, loads=loads)
    return markdown, figures, runs


def parity_section(runs: dict[str, list[dict[str, float]]], *, steps: int, loads: list[float]
                   ) -> tuple[str, dict[str, str]]:
    """The parity section's markdown and key figures from its runs (seed order)."""
    seeds = len(runs["colocated"])

    def mean(arm: str, key: str = "reward_last") -> float:
        return sum(r[key] for r in runs[arm]) / len(runs[arm])

    base = mean("colocated")
    rows, figures = [], {}
    for arm in ARMS:
        per_seed = " / ".join(f"{r['reward_last']:.3f}" for r in runs[arm])
        share = f"{100 * mean(arm) / base:.0f}%"
        rows.append([arm, f"{mean(arm):.3f}", per_seed, share,
                     "" if arm == "colocated" else f"{mean(arm, 'multi_version'):.3f}",
                     "" if arm == "colocated" else str(int(sum(r["masked"] for r in runs[arm]))),
                     "" if arm == "colocated" else f"{mean(arm, 'staleness'):.3f}",
                     "" if arm not in PARITY_GAP else
                     f"{mean(arm, 'fresh_gap_mean'):.4f} / "
                     f"{max(r['fresh_gap_max'] for r in runs[arm]):.3f}"])
        if arm != "colocated":
            figures[PARITY_FIGURE[arm]] = share
    keep_vs = f"{100 * mean('in-flight, kv keep') / mean('in-flight, kv recompute'):.0f}%"
    figures["parity_keep_vs_recompute"] = keep_vs
    keep_vs_off = f"{100 * mean('in-flight, kv keep') / mean('disaggregated, no in-flight'):.0f}%"
    figures["parity_keep_vs_disaggregated"] = keep_vs_off

    def paired(a: str, b: str) -> str:  # per seed, a's figure minus b's: the seeds' own spread
        d = [x["reward_last"] - y["reward_last"] for x, y in zip(runs[a], runs[b])]
        return f"{min(d):+.3f} to {max(d):+.3f}"
    markdown = "\n\n".join([
        "### Learning parity and the KV-cache ablation",
        (f"The GRPO preset (pattern task, `engine=native`, {steps} steps), seeds 0-{seeds - 1} "
         "interleaved across the arms; colocated; disaggregated (2 workers on `tq/backend=ray`, "
         "`recipe.max_staleness=1`, the per-token truncated IS correction `token_tis`) without "
         "in-flight updates, and with them, the KV cache kept or recomputed. Figure: each run's "
         f"mean reward over its last {LAST} steps, averaged over the seeds (load average at the "
         f"runs' starts: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores). Goal: "
         f"in-flight >= 95% of colocated. In-flight (kept cache) against the disaggregated "
         f"topology without it: {keep_vs_off}; kept cache against recomputed: {keep_vs}. "
         "Token staleness = the steps' mean `token_staleness_mean`. Fresh tokens' logprob "
         "gap: |generation - prev logprob| over the tokens generated with the trainer's own "
         "version (`fresh_logprob_gap_mean`, weighted by `fresh_tokens`, and the largest "
         "`fresh_logprob_gap`): 0 where the weights that sampled a token scored its whole "
         "context; with the cache kept, the tokens decoded after a mid-generation load saw the "
         "old weights' keys and values, and the gap is what that changed in their logprobs."),
        table(["arm", f"reward, last {LAST} steps", "per seed", "of colocated",
               "rows on 2 versions", "tokens masked", "token staleness",
               "fresh tokens' logprob gap, mean / max"], rows),
        (f"Per seed, kept minus colocated: {paired('in-flight, kv keep', 'colocated')}; kept "
         f"minus disaggregated without in-flight updates: "
         f"{paired('in-flight, kv keep', 'disaggregated, no in-flight')}; kept minus "
         f"recomputed: {paired('in-flight, kv keep', 'in-flight, kv recompute')}. The two "
         "caches differ only in the tokens decoded after a mid-generation load (on the rows "
         "that span two versions), and there by what the fresh tokens' gap shows. A "
         "disaggregated run's timing decides which rows those are and which weights a ticket "
         "starts on, and moves its reward as much as its seed does (one arm and seed run twice "
         "has differed by more than 0.2), so five seeds tell arms apart only by more than "
         "that. A ticket for step t starts on weights of "
         "version t - 1 in every disaggregated arm; in-flight updates only freshen the tokens "
         "decoded after the next publish lands (the token staleness column)."),
    ])
    return markdown, figures


def ceiling(idle: float) -> str:
    """What in-flight updates can give at most: they shorten the trainer's wait for rows, and a
    run whose trainer waits ``idle`` of the time without them gains at most 1 / (1 - idle)."""
    return (f"Where the time goes: without in-flight updates the trainer waits for rows "
            f"{idle:.0%} of the time (median), so removing every wait gives at most "
            f"{1 / (1 - idle):.2f}x the steps/s; the rest is the trainer's own step (4 PPO "
            "epochs over 64 rows of up to 80 tokens). In-flight updates shorten no wait in this "
            "design: a ticket for step t starts once version t - 1 is published, with or "
            "without them, and decodes no faster (its loads of every mid-step publish cost "
            "decode time; its looks for them cost no store round trip on Ray, where a thread "
            "waits in a claim of the weights partition); they make the tokens decoded after the "
            "next publish fresher. A steps/s "
            "gain needs a ticket to start sooner or to deliver before its longest completion "
            "(partial rollouts), neither built.")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--arms", nargs="*", default=["speed", "parity"],
                        choices=["speed", "parity"])
    parser.add_argument("--parity-seeds", type=int, default=5)
    parser.add_argument("--parity-steps", type=int, default=120)
    parser.add_argument("--parity-first-seed", type=int, default=0)
    parser.add_argument("--parity-arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    args = parser.parse_args(argv if argv is not None else [])
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    parity_md, parity_figures, parity_runs = ("", {}, {})
    if "parity" in args.arms:
        parity_md, parity_figures, parity_runs = parity(
            seeds=args.parity_seeds, steps=args.parity_steps, first_seed=args.parity_first_seed,
            arms=args.parity_arms)
    if "speed" not in args.arms:
        return {"markdown": parity_md, "key_figures": parity_figures, "results": parity_runs}
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
    vs_colocated = ""
    if "colocated" in results and "in-flight, kv keep" in results:
        colocated = Stat.of([r["steps_per_s"] for r in results["colocated"]]).median
        keep = Stat.of([r["steps_per_s"] for r in results["in-flight, kv keep"]]).median
        figures["inflight_vs_colocated"] = f"{keep / colocated:.2f}x"
        vs_colocated = (f" Disaggregated with in-flight updates (kv keep) against colocated: "
                        f"{keep / colocated:.2f}x the steps/s (goal 1.4x); the colocated "
                        "row's trainer idle is the share of the window it spends generating.")
    markdown = "\n\n".join([
        "## In-flight weight updates (`bench_inflight`)",
        (f"GRPO, 2 workers on `tq/backend=ray`, `recipe.max_staleness=1`, pattern targets "
         f"U(4, 64) symbols, up to 64 new tokens, one turn; {args.steps} steps, seed 0, "
         f"{args.repeats} alternating repeats (load average at the runs' starts: "
         f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores). Steps/s over steady "
         "state; trainer idle = share of it waiting for rows; tokens/s = generated tokens; "
         "token staleness = the steps' mean of `token_staleness_mean`, and the largest "
         "`token_staleness_max`; rows spanning two versions = the steps' mean "
         "`multi_version_fraction`. Goal: in-flight >= 1.3x the steps/s without." + vs_colocated),
        table(["kind", "steps/s", "vs without", "trainer idle", "generated tokens/s",
               "mean completion", "token staleness mean", "max", "rows on 2 versions",
               "tokens masked"], rows),
        ceiling(Stat.of([r["idle"] for r in results[args.kinds[0]]]).median),
        *([parity_md] if parity_md else []),
    ])
    print(markdown)
    return {"markdown": markdown, "key_figures": parity_figures | figures,
            "results": {**results, **parity_runs}}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
