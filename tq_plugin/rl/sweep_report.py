"""Hydra callback: after a multirun, compare the jobs in the sweep dir.

Writes ``comparison.csv``, ``comparison.md`` and ``comparison.png`` (tokens/s, padded-token
fraction, peak memory and final reward per job). Every job directory is listed: a job that
failed appears with its error, one that left no result at all appears as ``missing``.
Imports stay light (no torch): Hydra builds callbacks before any job runs.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
RESULT_FILE = "result.json"
COLUMNS = ["job", "overrides", "status", "tokens_per_s", "padded_fraction", "peak_rss_mb",
           "max_microbatch_tokens", "reward_first", "reward_last", "reward_last_avg", "dp_bytes",
           "wall_s", "error"]
LAST_REPORT: dict[str, Any] = {}


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()]
    return sorted(dirs, key=lambda p: (int(p.name.split("_")[0]) if p.name.split("_")[0].isdigit()
                                       else 1 << 30, p.name))


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job dir; ``overrides`` shows what varies between jobs (the swept values)."""
    jobs = []
    for job in _job_dirs(sweep_dir):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = list(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
        jobs.append((job, overrides))
    common = set.intersection(*(set(o) for _, o in jobs)) if len(jobs) > 1 else set()
    rows = []
    for job, overrides in jobs:
        swept = [o for o in overrides if o not in common]
        row: dict[str, Any] = {"job": job.name, "overrides": " ".join(swept)}
        result_file = job / RESULT_FILE
        if result_file.exists():
            result = json.loads(result_file.read_text())
            row.update({k: result.get(k) for k in COLUMNS if k in result})
            row["status"] = result.get("status", "ok")
        else:
            row.update(status="missing", error="the job left no result.json (killed or crashed)")
        rows.append(row)
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_report(sweep_dir: Path) -> dict[str, Any]:
    rows = collect(sweep_dir)
    with open(sweep_dir / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows([{k: r.get(k) for k in COLUMNS} for r in rows])
    shown = [c for c in COLUMNS if c not in ("error",)]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in shown) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed jobs:"]
        lines += [f"- `{r['job']}`: {r.get('error')}" for r in failed]
    (sweep_dir / "comparison.md").write_text("\n".join(lines) + "\n")
    _plot(rows, sweep_dir / "comparison.png")
    return {"rows": rows, "failed": len(failed), "dir": str(sweep_dir)}


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["overrides"].replace(" ", "\n") or r["job"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(14, 2 + 0.45 * max(len(labels), 1)), sharey=True)
    for ax, (key, title) in zip(axes, [("tokens_per_s", "train tokens/s"),
                                      ("padded_fraction", "padded-token fraction"),
                                      ("peak_rss_mb", "peak RSS (MB)"),
                                      ("reward_last_avg", "final reward")]):
        values = [r.get(key) or 0.0 for r in rows]
        colours = ["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows]
        ax.barh(range(len(rows)), values, color=colours)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class SweepReport(Callback):
    """Registered in the primary config under ``hydra.callbacks``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        report = write_report(sweep_dir)
        LAST_REPORT.clear()
        LAST_REPORT.update(report)
        log.info("sweep comparison: %s", sweep_dir / "comparison.md")
        print((sweep_dir / "comparison.md").read_text(), flush=True)
        if report["failed"]:
            log.error("%d of %d sweep jobs failed (see comparison.md)", report["failed"],
                      len(report["rows"]))
