"""Soak (slow tier): >= 8 threads stage, finalize and clear >= 100,000 calls; memory comes back."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("tq_soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 202 s on a quiet 2-core box; eight threads on two cores under load
def test_eight_threads_stage_finalize_and_clear_100k_calls_and_memory_returns():
    r = soak.run_soak(threads=8, calls=100_000)
    print(
        f"\nsoak: {r['calls']:,} calls in {r['seconds']:.1f} s = {r['calls_per_s']:,.0f} calls/s; "
        f"stage p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us; RSS {r['rss_start_mb']:.0f} -> "
        f"{r['rss_peak_mb']:.0f} -> {r['rss_end_mb']:.0f} MB; bytes held peak "
        f"{r['bytes_held_peak']:,} -> end {r['bytes_held_end']:,}"
    )
    assert r["calls"] >= 100_000
    assert r["rows_left"] == 0
    assert r["bytes_held_end"] <= 0.1 * r["bytes_held_peak"]
    assert r["rss_end_mb"] <= 1.1 * r["rss_start_mb"]
