"""Hydra callback: after a multirun, compare the jobs in the sweep dir.

Writes ``comparison.csv`` / ``comparison.md`` (one row per job) and
``comparison_by_setting.csv`` / ``comparison_by_setting.md`` / ``comparison.png`` (one row and one
bar per setting: mean ± std over seeds of tokens/s, padded-token fraction, peak memory and final
reward; jobs that are the same run, e.g. ``tq/packing=none`` at two token budgets, count as one
setting). Every job directory is listed: a job that failed appears with its error, one that left
no result at all appears as ``missing``.
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

from tq_plugin.config.sweeps import setting_key

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
        config_file = job / ".hydra" / "config.yaml"
        if config_file.exists():
            row["packing_mode"] = OmegaConf.select(OmegaConf.load(config_file), "tq.packing.name")
        result_file = job / RESULT_FILE
        if result_file.exists():
            result = json.loads(result_file.read_text())
            row.update({k: result.get(k) for k in COLUMNS if k in result})
            row["status"] = result.get("status", "ok")
        else:
            row.update(status="missing", error="the job left no result.json (killed or crashed)")
        rows.append(row)
    return rows


AGGREGATED = ["reward_last_avg", "tokens_per_s", "padded_fraction", "peak_rss_mb"]


def setting_of(overrides: str, packing_mode: str | None = None) -> str:
    """A job's setting: its swept overrides without the seed and without the keys its packing
    mode ignores (``tq/packing=none`` at two token budgets is one setting), in their order."""
    parts = overrides.split()
    kept = set(setting_key(parts, packing_mode))
    return " ".join(o for o in parts if o in kept)


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting: how many jobs (seeds) succeeded, and mean and std of each figure."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(setting_of(r.get("overrides", ""), r.get("packing_mode")), []).append(r)
    out = []
    for setting, members in groups.items():
        ok = [r for r in members if r.get("status") == "ok"]
        entry: dict[str, Any] = {"setting": setting or "(defaults)", "jobs": len(members),
                                 "ok": len(ok)}
        for key in AGGREGATED:
            values = [float(r[key]) for r in ok if r.get(key) is not None]
            mean = sum(values) / len(values) if values else None
            std = ((sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
                   if len(values) > 1 else 0.0 if values else None)
            entry[f"{key}_mean"], entry[f"{key}_std"] = mean, std
        out.append(entry)
    return out


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
    settings = aggregate(rows)
    table = ["Per setting (mean ± std over seeds and jobs that are the same run):", "",
             "| setting | ok/jobs | " + " | ".join(AGGREGATED) + " |",
             "|---|---|" + "---|" * len(AGGREGATED)]
    for e in settings:
        cells = [f"{_fmt(e[f'{k}_mean'])} ± {_fmt(e[f'{k}_std'])}" for k in AGGREGATED]
        table.append(f"| {e['setting']} | {e['ok']}/{e['jobs']} | " + " | ".join(cells) + " |")
    (sweep_dir / "comparison_by_setting.md").write_text("\n".join(table) + "\n")
    with open(sweep_dir / "comparison_by_setting.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(settings[0]) if settings else ["setting"])
        writer.writeheader()
        writer.writerows(settings)
    _plot(settings, sweep_dir / "comparison.png")
    return {"rows": rows, "settings": settings, "failed": len(failed), "dir": str(sweep_dir)}


def _plot(settings: list[dict[str, Any]], path: Path) -> None:
    """One bar per setting (every setting, failed ones in red), mean with a ± std error bar."""
    try:
        import matplotlib
    except ImportError:  # plotting is the `plot` extra
        log.warning("matplotlib is not installed: no %s (pip install 'tq_plugin[plot]')", path.name)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [e["setting"].replace(" ", "\n") for e in settings]
    height = 2 + 0.55 * max(len(labels), 1)
    fig, axes = plt.subplots(1, 4, figsize=(14, height), sharey=True)
    for ax, (key, title) in zip(axes, [("tokens_per_s", "train tokens/s"),
                                      ("padded_fraction", "padded-token fraction"),
                                      ("peak_rss_mb", "peak RSS (MB)"),
                                      ("reward_last_avg", "final reward")]):
        values = [e[f"{key}_mean"] or 0.0 for e in settings]
        errors = [e[f"{key}_std"] or 0.0 for e in settings]
        colours = ["tab:blue" if e["ok"] else "tab:red" for e in settings]
        ax.barh(range(len(settings)), values, xerr=errors, color=colours, capsize=3)
        ax.set_yticks(range(len(settings)), labels, fontsize=7)
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
        print((sweep_dir / "comparison_by_setting.md").read_text(), flush=True)
        if report["failed"]:
            log.error("%d of %d sweep jobs failed (see comparison.md)", report["failed"],
                      len(report["rows"]))
