"""Run every benchmark and write ``benchmarks/RESULTS.md`` (``make bench``).

Each ``bench_*`` module exposes ``main() -> dict`` with a ``"markdown"`` entry. Figures depend on
the machine and on what else it is doing: re-run on an idle machine before comparing numbers.
"""

from __future__ import annotations

import datetime
import importlib
import pathlib
import sys

from benchmarks._common import machine

MODULES = ["bench_data_plane", "bench_backends", "bench_packing", "bench_lightning", "bench_staging",
           "bench_topology", "soak"]
HERE = pathlib.Path(__file__).parent


def main(argv: list[str] | None = None) -> None:
    wanted = (argv if argv is not None else sys.argv[1:]) or MODULES
    sections = []
    for name in wanted:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}", flush=True)
        sections.append(module.main()["markdown"])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n\n".join(
        [
            "# Benchmark results",
            f"Measured {stamp} with `make bench` on: {machine()}.",
            "Medians of repeated runs; every ratio compares figures taken in the same run.",
            *sections,
        ]
    )
    (HERE / "RESULTS.md").write_text(text + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
