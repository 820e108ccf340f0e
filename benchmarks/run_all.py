"""Run every benchmark and write ``benchmarks/RESULTS.md`` (``make bench``).

Each ``bench_*`` module exposes ``main() -> dict`` with a ``"markdown"`` entry. Figures depend on
the machine and on what else it is doing: re-run on an idle machine before comparing numbers.
"""

from __future__ import annotations

import datetime
import importlib
import pathlib
import re
import sys

from benchmarks._common import machine

MODULES = ["bench_data_plane", "bench_backends", "bench_packing", "bench_lightning", "bench_staging",
           "bench_topology", "bench_engines", "bench_agent_endpoint", "bench_fsdp", "bench_logprobs",
           "bench_real_shapes", "bench_real_lengths", "bench_parity", "bench_toy_steps",
           "bench_real_extra",
           "bench_real_model", "bench_lora",
           "soak", "reliability", "async_resume"]
HERE = pathlib.Path(__file__).parent


_MEASURED = re.compile(r"^_Measured [^\n]*$", re.MULTILINE)


def committed_sections(results: pathlib.Path) -> list[str]:
    """The sections of an existing ``RESULTS.md`` (each ends with its ``_Measured ..._`` line),
    so re-measuring one module on a fresh clone keeps every other module's figures."""
    if not results.exists():
        return []
    text, out = results.read_text(), []
    start = text.find("\n#", 1) + 1  # the first heading after the title and the preamble
    for m in _MEASURED.finditer(text):
        out.append(text[start:m.end()].strip())
        start = m.end()
    return [section for section in out if section]


def _heading(section: str) -> str:
    return section.strip().splitlines()[0].strip()


def main(argv: list[str] | None = None) -> None:
    """Run the named benchmarks (default: all), keep each section in ``benchmarks/out/``, and
    rewrite ``RESULTS.md``: each measured section replaces the one with its heading (sections
    of other modules are kept as they were), new ones are added in ``MODULES`` order."""
    wanted = (argv if argv is not None else sys.argv[1:]) or MODULES
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    for name in wanted:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}", flush=True)
        section = module.main()["markdown"]
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        (out_dir / f"{name}.md").write_text(f"{section}\n\n_Measured {stamp}._\n")
    sections = committed_sections(HERE / "RESULTS.md")
    for name in MODULES:
        path = out_dir / f"{name}.md"
        if not path.exists():
            continue
        fresh = path.read_text().rstrip()
        same = [i for i, old in enumerate(sections) if _heading(old) == _heading(fresh)]
        if same:
            sections[same[0]] = fresh
        else:
            sections.append(fresh)
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
