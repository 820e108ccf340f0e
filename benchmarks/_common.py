"""Shared helpers for the benchmarks: timing, machine description, Markdown tables."""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple


def median_seconds(fn: Callable[[], object], *, runs: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Stat(NamedTuple):
    """min / median / max of repeated measurements (seconds, or any figure)."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        return cls(min(values), statistics.median(values), max(values))

    def map(self, fn: Callable[[float], float]) -> Stat:
        """Apply ``fn`` to each figure, keeping min <= median <= max (e.g. seconds -> rate)."""
        a, b, c = fn(self.min), fn(self.median), fn(self.max)
        return Stat(min(a, c), b, max(a, c))

    def fmt(self, spec: str = ",.0f", unit: str = "") -> str:
        """``median (min–max)``."""
        return f"{self.median:{spec}}{unit} ({self.min:{spec}}–{self.max:{spec}})"


def interleaved(fns: dict[str, Callable[[], object]], *, runs: int = 9, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each ``fn`` per run, taking turns (A, B, A, B, ...) so that whatever else the
    machine does falls on every contender alike. Results of a call are dropped before the next."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t)
            del out
    return times


def ratios(numerator: list[float], denominator: list[float]) -> Stat:
    """Per-run ratios of two interleaved series (run i against run i)."""
    return Stat.of([a / b for a, b in zip(numerator, denominator)])


def rounds_stat(rounds: Sequence[dict[str, list[float]]], num: str, den: str) -> Stat:
    """Per round, median(``num``) / median(``den``) of its interleaved runs; then median
    (min–max) over the rounds: the figure a loaded box moves least (not a best-case run)."""
    return Stat.of([statistics.median(r[num]) / statistics.median(r[den]) for r in rounds])


def _where(filename: str) -> str:
    """A profile entry's file, short: the path below site-packages or the repository."""
    for marker in ("site-packages/", "/tq_plugin/", "/benchmarks/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker == "site-packages/" else marker.strip("/") + "/" + tail
    stdlib = re.search(r"/lib/python3\.\d+/(.*)", filename)
    return stdlib.group(1) if stdlib else filename


def profile_table(fn: Callable[[], object], *, ops: int, top: int = 15) -> tuple[str, float]:
    """cProfile of ``fn``, which runs ``ops`` operations: the ``top`` entries by own time as a
    Markdown table per operation (calls, own µs, cumulative µs), and the profiled µs per
    operation (cProfile's own overhead included: per-call Python costs show larger than they
    run, so read the shares, not the sum)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_cc, calls, own, cumulative, _callers) in entries:
        where = name if filename == "~" else f"{_where(filename)}:{line} {name}"
        rows.append([f"`{where}`", f"{calls / ops:,.1f}", f"{own / ops * 1e6:,.1f}",
                     f"{cumulative / ops * 1e6:,.1f}"])
    text = table(["function", "calls / op", "own µs / op", "cumulative µs / op"], rows)
    return text, stats.total_tt / ops * 1e6  # type: ignore[attr-defined]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# Variables a distributed launcher sets; a fresh ``tq-train`` must not inherit them.
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_", "GLOBAL_RANK")


class TrainRun(NamedTuple):
    """A finished ``tq-train`` run: its ``result.json``, its ``metrics.csv`` rows and the
    command's wall seconds (imports and start-up included)."""

    result: dict[str, Any]
    rows: list[dict[str, str]]
    wall_s: float


def tq_train(overrides: Sequence[str], *, timeout_s: float = 1800) -> TrainRun:
    """Run ``tq-train <overrides>`` to its end in a fresh process and run dir (launcher
    variables dropped); ``RuntimeError`` with its stderr's tail when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    with tempfile.TemporaryDirectory(prefix="tq-bench-run-") as out:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tq_plugin.cli", *overrides,
                               f"hydra.run.dir={out}", "trainer.enable_progress_bar=false"],
                              env=env, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"tq-train {' '.join(overrides)} exited {proc.returncode}: "
                               f"{proc.stderr[-3000:]}")
        result = json.loads((Path(out) / "result.json").read_text())
        with open(Path(out) / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    return TrainRun(result, rows, wall)
