"""``reward_curve.png``: one figure of a run, its panels the reward (train, and eval where the
run evaluated), the loss, the KL, the entropy and the training tokens/s per RL step, titled with
the recipe, the model and the engine. Needs matplotlib (the ``plot`` extra); without it the plot
is skipped with a warning, never the run."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

# (panel title, [(metrics.csv column, label)]): a column the rows lack is left out, a panel
# with none of its columns is drawn empty with a note.
PANELS = (
    ("reward", [("reward", "train (mean over turns)"), ("eval/reward", "eval (greedy)")]),
    ("loss", [("loss", "policy loss"), ("value_loss", "value loss")]),
    ("KL", [("kl_ref", "to the reference"), ("approx_kl", "to the rows' policy")]),
    ("entropy", [("entropy", "per action token")]),
    ("tokens/s", [("tokens_per_s", "training")]),
)


def _series(rows: list[dict[str, Any]], column: str) -> tuple[list[float], list[float]]:
    """The steps and values of ``column`` where a row has a number for it."""
    steps, values = [], []
    for row in rows:
        value = row.get(column, "")
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isnan(number):
            steps.append(float(row["step"]))
            values.append(number)
    return steps, values


def run_title(cfg: Any) -> str:
    """``grpo · tiny_transformer · engine native`` from a run's config."""
    recipe = cfg.get("recipe", {}) or {}
    model = cfg.get("model", {}) or {}
    engine = cfg.get("engine", {}) or {}
    return (f"{recipe.get('algorithm', '?')} · {model.get('name', '?')} · "
            f"engine {engine.get('name', 'native')}")


def plot_run(rows: list[dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """Write the figure to ``path`` (None, with a warning, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning(
            "matplotlib is not installed: no %s (pip install 'tq_plugin[plot]')", path.name)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for ax, (name, columns) in zip(axes, PANELS, strict=True):
        drawn = 0
        for column, label in columns:
            steps, values = _series(rows, column)
            if not values or (column in ("value_loss", "kl_ref") and not any(values)):
                continue  # GRPO has no value model; beta = 0 has no reference KL
            style = {"marker": "o", "linestyle": "--"} if column.startswith("eval/") else {}
            ax.plot(steps, values, label=label, **style)
            drawn += 1
        ax.set_title(name)
        ax.set_xlabel("RL step")
        if drawn > 1:
            ax.legend(loc="best", fontsize=8)
        elif not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["PANELS", "plot_run", "run_title"]
