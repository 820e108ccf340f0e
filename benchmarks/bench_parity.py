"""Do asynchronous runs learn like synchronous ones? GRPO colocated against disaggregated.

The same recipe, task and seeds, three ways: colocated (on-policy), disaggregated with 2 rollout
workers at ``max_staleness=1`` (the default importance correction, ``token_tis``), and at
``max_staleness=4`` with the decoupled objective (``recipe.is_correction.mode=decoupled``). Each
run's score is the mean reward of its last 20 steps (fewer steps: the last sixth). Per config:
the mean over seeds with its 95% interval (Student t); per disaggregated config: the paired
difference to colocated, seed by seed, with its 95% interval, and the ratio of the means.

    python -m benchmarks.run_all bench_parity       # TQ_PARITY_SEEDS=0,1,...  TQ_PARITY_STEPS=N

The runs go one seed at a time, the configs interleaved within a seed, so load on the machine
falls on every config alike. ``docs/parity_reward.png``: the mean reward curve of each config.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks._common import table, tq_train

HERE = Path(__file__).resolve().parent
PLOT = HERE.parent / "docs" / "parity_reward.png"
DISAGG = ["tq/backend=ray", "recipe.topology=disaggregated", "recipe.rollout_workers=2"]
CONFIGS = {
    "colocated": [],
    "disaggregated, staleness 1": [*DISAGG, "recipe.max_staleness=1"],
    "disaggregated, staleness 4, decoupled": [*DISAGG, "recipe.max_staleness=4",
                                               "recipe.is_correction.mode=decoupled"],
}
# Two-sided 95% Student t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def interval(values: list[float]) -> tuple[float, float]:
    """``(mean, half width of the 95% interval)``; the half width is nan for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    df = len(values) - 1
    t = T95.get(df) or T95[max(k for k in T95 if k <= df)]
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


def last_mean(rows: list[dict[str, str]], window: int) -> float:
    rewards = [float(r["reward"]) for r in rows]
    return statistics.fmean(rewards[-window:])


def _plot(curves: dict[str, list[list[float]]]) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, runs in curves.items():
        n = min(len(r) for r in runs)
        mean = [statistics.fmean(r[i] for r in runs) for i in range(n)]
        smooth = [statistics.fmean(mean[max(0, i - 9):i + 1]) for i in range(n)]
        ax.plot(range(n), smooth, label=f"{name} ({len(runs)} seeds)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (mean over seeds, 10-step window)")
    ax.set_title("GRPO, pattern task: colocated vs disaggregated")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def main() -> dict[str, Any]:
    seeds = [int(s) for s in os.environ.get("TQ_PARITY_SEEDS", "0,1,2,3,4,5,6,7").split(",")]
    steps = int(os.environ.get("TQ_PARITY_STEPS", "120"))
    window = min(20, max(1, steps // 6))
    scores: dict[str, list[float]] = {name: [] for name in CONFIGS}
    curves: dict[str, list[list[float]]] = {name: [] for name in CONFIGS}
    stale: dict[str, int] = {name: 0 for name in CONFIGS}
    for seed in seeds:
        for name, overrides in CONFIGS.items():
            run = tq_train(["recipe=grpo", f"recipe.num_steps={steps}", f"recipe.seed={seed}",
                            *overrides])
            scores[name].append(last_mean(run.rows, window))
            curves[name].append([float(r["reward"]) for r in run.rows])
            stale[name] = max(stale[name], int(run.result.get("staleness_max", 0)))
            print(f"seed {seed} {name}: {scores[name][-1]:.3f}", flush=True)
    _plot(curves)
    base = scores["colocated"]
    rows = []
    for name, values in scores.items():
        mean, half = interval(values)
        if name == "colocated":
            rows.append([name, f"{mean:.3f} ± {half:.3f}", "", "", stale[name]])
            continue
        diff, diff_half = interval([v - b for v, b in zip(values, base, strict=True)])
        rows.append([name, f"{mean:.3f} ± {half:.3f}", f"{diff:+.3f} ± {diff_half:.3f}",
                     f"{mean / statistics.fmean(base):.2f}", stale[name]])
    markdown = "\n\n".join([
        "## Async parity (`bench_parity`)",
        (f"GRPO on the pattern task, {steps} steps, seeds {seeds}: the mean reward of each run's "
         f"last {window} steps, then the mean over seeds ± the 95% interval (t). Paired: "
         "disaggregated minus colocated, seed by seed. Ratio: disaggregated mean / colocated "
         "mean (goal >= 0.95). Plot: `docs/parity_reward.png`."),
        table(["config", "last-steps reward", "paired difference", "ratio", "staleness max"],
              rows),
    ])
    return {"markdown": markdown, "scores": scores}


if __name__ == "__main__":
    print(main()["markdown"])
