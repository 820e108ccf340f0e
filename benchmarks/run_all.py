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
           "bench_topology", "bench_engines", "bench_fsdp", "soak", "reliability", "async_resume"]
HERE = pathlib.Path(__file__).parent


def main(argv: list[str] | None = None) -> None:
    """Run the named benchmarks (default: all), keep each section in ``benchmarks/out/``, and
    rebuild ``RESULTS.md`` from every section measured so far, in ``MODULES`` order."""
    wanted = (argv if argv is not None else sys.argv[1:]) or MODULES
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    for name in wanted:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}", flush=True)
        section = module.main()["markdown"]
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        (out_dir / f"{name}.md").write_text(f"{section}\n\n_Measured {stamp}._\n")
    sections = [(out_dir / f"{n}.md").read_text().rstrip() for n in MODULES
                if (out_dir / f"{n}.md").exists()]
    text = "\n\n".join(
        [
            "# Benchmark results",
            f"Written by `make bench` on: {machine()}.",
            ("Every figure is the median (min–max) of repeated runs unless it says otherwise; "
            "every ratio compares figures taken in the same run, interleaved."),
            *sections,
        ]
    )
    (HERE / "RESULTS.md").write_text(text + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
