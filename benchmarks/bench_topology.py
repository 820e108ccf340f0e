"""Topologies: steps/s and trainer-idle fraction, colocated against disaggregated.

The same recipe (``recipe=ppo`` by default: 16 prompts x 4 samples, 4 epochs per step), the same
seed and step count, one torch thread per process, run in this process through ``RLRecipe``:

* ``colocated`` on ``tq/backend=local`` (today's default) and on ``tq/backend=ray``;
* ``disaggregated`` on ``tq/backend=ray`` with ``recipe.rollout_workers`` 1 and 2,
  ``recipe.max_staleness=1``, weights published after every optimizer step (the default), and
  with 1 worker also once per RL step (``recipe.weights_every=rl_step``).

Steps/s is measured over steady state: from the first microbatch of step 1 to the end of the
fit (start-up, Ray and worker start included in neither). Trainer-idle fraction is the share of
that window the trainer spends neither preparing nor training a step: generating its own
rollouts (colocated: ``rollout_s``) or waiting for rows (disaggregated: ``trainer_wait_s``).
Runs alternate kinds (A, B, C, A, B, C, ...) so load from elsewhere falls on each alike; the
table shows medians (min-max) over the repeats.

Run: ``.venv/bin/python -m benchmarks.bench_topology [--steps N] [--repeats R] [--recipe grpo]``;
``--curves colocated=RUN_DIR disaggregated=RUN_DIR --out docs/topology_reward.png`` plots the
reward curves of two recipe runs in one figure (``label=DIR1,DIR2,...``: the mean over seeds).
Target (issue #10): disaggregated with one worker >= 1.4x colocated steps/s on a 2-core box.
"""

from __future__ import annotations

import argparse
import csv
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch import Callback

from benchmarks._common import Stat, table
from tq_plugin.lightning import MICROBATCH_INFO
from tq_plugin.rl.recipe import RLRecipe

KINDS = {
    "colocated, local": ["recipe.topology=colocated"],
    "colocated, ray": ["recipe.topology=colocated", "tq/backend=ray"],
    "disaggregated, ray, 1 worker": ["recipe.topology=disaggregated", "tq/backend=ray",
                                     "recipe.rollout_workers=1", "recipe.max_staleness=1"],
    "disaggregated, ray, 1 worker, weights per RL step": [
        "recipe.topology=disaggregated", "tq/backend=ray", "recipe.rollout_workers=1",
        "recipe.max_staleness=1", "recipe.weights_every=rl_step"],
    "disaggregated, ray, 2 workers": ["recipe.topology=disaggregated", "tq/backend=ray",
                                      "recipe.rollout_workers=2", "recipe.max_staleness=1"],
}


class _Window(Callback):
    """Time from the first microbatch of step 1 to the end of the fit."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None and pl_module.dp_meta.extra_info[MICROBATCH_INFO]["step"] == 1:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.end = time.perf_counter()


def timed_fit(recipe: str, overrides: list[str]) -> tuple[float, list[dict[str, str]]]:
    """Fit ``recipe`` with ``overrides`` (one torch thread, CSV logger) in a temporary run dir;
    returns the seconds from step 1 to the end of the fit and the metrics rows of those steps."""
    GlobalHydra.instance().clear()
    with tempfile.TemporaryDirectory() as out:
        with initialize_config_module(config_module="tq_plugin.conf", version_base="1.3"):
            cfg = compose(recipe, overrides=[
                *overrides, "recipe.num_threads=1", "trainer.enable_progress_bar=false",
                "logger=csv"])
        GlobalHydra.instance().clear()
        rl = RLRecipe(cfg, out)
        rl.setup()
        window = _Window()
        rl.trainer.callbacks.append(window)
        rl.train()
        with open(Path(out) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))[1:]  # the steps in the window
    return window.end - window.start, rows


def run_once(kind: str, *, recipe: str, steps: int, seed: int) -> dict[str, float]:
    span, rows = timed_fit(recipe, [*KINDS[kind], f"recipe.num_steps={steps}",
                                    f"recipe.seed={seed}"])
    idle_key = "trainer_wait_s" if "disaggregated" in kind else "rollout_s"
    return {"steps_per_s": (steps - 1) / span,
            "idle": sum(float(r[idle_key]) for r in rows) / span,
            "reward_last": float(rows[-1]["reward"]),
            "staleness_max": max((int(r.get("staleness_max", 0)) for r in rows), default=0)}


def measure(*, recipe: str = "ppo", steps: int = 12, repeats: int = 3, seed: int = 0,
            kinds: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    kinds = kinds or list(KINDS)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for kind in kinds:
            results[kind].append(run_once(kind, recipe=recipe, steps=steps, seed=seed))
            print(f"  {kind}: {results[kind][-1]}", flush=True)
    return results


def _mean_reward(run_dirs: str) -> tuple[list[int], list[float]]:
    """Steps and reward per step of one run, or the mean over several (``dir1,dir2,...``: seeds
    of one setting), from their ``metrics.csv``."""
    per_run = []
    for run_dir in run_dirs.split(","):
        with open(Path(run_dir) / "metrics.csv") as f:
            per_run.append({int(r["step"]): float(r["reward"]) for r in csv.DictReader(f)})
    steps = sorted(set.intersection(*(set(r) for r in per_run)))
    return steps, [sum(r[s] for r in per_run) / len(per_run) for s in steps]


def plot_curves(runs: dict[str, str], out: Path, *, window: int = 10) -> None:
    """Reward per step of each run (its ``metrics.csv``; comma-separated dirs: their mean) and
    its moving average, in one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, run_dir), color in zip(runs.items(), ["tab:blue", "tab:orange", "tab:green"]):
        steps, reward = _mean_reward(run_dir)
        smooth = [sum(reward[max(0, i - window + 1):i + 1]) / len(reward[max(0, i - window + 1):i + 1])
                  for i in range(len(reward))]
        ax.plot(steps, reward, color=color, alpha=0.25)
        ax.plot(steps, smooth, color=color, label=f"{label} ({window}-step mean)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean rollout reward")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="ppo")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--curves", nargs="*", metavar="LABEL=RUN_DIR",
                        help="plot these runs' reward curves to --out instead of measuring")
    parser.add_argument("--out", type=Path, default=Path("docs/topology_reward.png"))
    args = parser.parse_args(argv if argv is not None else [])
    if args.curves:
        plot_curves(dict(c.rsplit("=", 1) for c in args.curves), args.out)
        print(f"wrote {args.out}")
        return {"markdown": ""}
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    results = measure(recipe=args.recipe, steps=args.steps, repeats=args.repeats)
    base = Stat.of([r["steps_per_s"] for r in results["colocated, local"]])
    rows = []
    for kind, runs in results.items():
        rate = Stat.of([r["steps_per_s"] for r in runs])
        idle = Stat.of([r["idle"] for r in runs])
        rows.append([kind, rate.fmt(".2f"), f"{rate.median / base.median:.2f}x",
                     idle.fmt(".2f"), max(r["staleness_max"] for r in runs)])
    markdown = "\n\n".join([
        "## Topologies (`bench_topology`)",
        (f"`recipe={args.recipe}`, {args.steps} steps, seed 0, one torch thread per process, "
         f"{args.repeats} alternating repeats; steps/s over steady state (step 1 to the end), "
         "trainer-idle = share of that time the trainer generates (colocated) or waits for rows "
         "(disaggregated). Target: disaggregated with 1 worker >= 1.4x colocated (local)."),
        table(["topology, backend", "steps/s", "vs colocated, local", "trainer idle",
               "max staleness"], rows),
    ])
    print(markdown)
    return {"markdown": markdown, "results": results}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
