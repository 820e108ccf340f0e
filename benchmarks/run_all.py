"""Run benchmarks and record each one's results (``make bench``).

Each ``bench_*`` module exposes ``main() -> dict`` with a ``"markdown"`` entry (its section of
``RESULTS.md``) and a ``"key_figures"`` entry: ``{name: figure}``, each figure a string exactly as
the section prints it (the README and docs headline tables cite them, ``benchmarks/headline.py``).
``python -m benchmarks.run_all [bench ...]`` (default: all) writes one file per bench measured,
``benchmarks/results/<bench>.json`` (command, date, machine, load average, markdown, figures),
then renders ``RESULTS.md`` and the headline tables from every results file
(``benchmarks/render.py``): a partial run rewrites the sections it measured and no other.
Figures depend on the machine and on what else it is doing: re-run on an idle machine before
comparing numbers.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import shlex
import sys

from benchmarks import render
from benchmarks._common import machine

MODULES = ["bench_data_plane", "bench_backends", "bench_packing", "bench_lightning", "bench_staging",
           "bench_durable",
           "bench_topology", "bench_inflight", "bench_fleet", "bench_engines", "bench_agent_endpoint",
           "bench_fsdp",
           "bench_logprobs",
           "bench_real_shapes", "bench_real_lengths", "bench_parity", "bench_toy_steps",
           "bench_real_extra",
           "bench_real_model", "bench_lora",
           "soak", "reliability", "async_resume"]
def key_figures(name: str, result: dict, markdown: str, previous: dict | None) -> dict[str, str]:
    """The bench's ``key_figures``; a bench that returns none yet keeps each earlier figure whose
    text its new section still prints (a figure it no longer prints is dropped, and rendering
    then fails naming it where a headline row cites it)."""
    if "key_figures" in result:
        figures = {str(k): str(v) for k, v in result["key_figures"].items()}
        missing = {k: v for k, v in figures.items() if v not in markdown}
        if missing:
            raise ValueError(f"{name}: key figures not printed in its section: {missing}")
        return figures
    old = (previous or {}).get("figures", {})
    kept = {k: v for k, v in old.items() if v in markdown}
    for k in sorted(set(old) - set(kept)):
        print(f"warning: {name}: figure {k!r} ({old[k]!r}) is not in the new section; dropped "
              "(return it from main() under 'key_figures')", file=sys.stderr)
    return kept


def record(name: str, result: dict, *, load: tuple[float, float, float] | None,
           argv: list[str]) -> dict:
    """The results file of one bench run."""
    markdown = result["markdown"].strip()
    path = render.RESULTS_DIR / f"{name}.json"
    previous = json.loads(path.read_text()) if path.exists() else None
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith(("TQ_BENCH", "TQ_PARITY"))]
    return {
        "bench": name,
        "command": " ".join([*env, "python -m benchmarks.run_all", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": [round(x, 2) for x in load] if load else None,
        "markdown": markdown,
        "figures": key_figures(name, result, markdown, previous),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the named benchmarks (default: all), write each one's ``results/<bench>.json`` as it
    finishes, then render ``RESULTS.md`` and the headline tables from every results file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = argv or MODULES
    unknown = [n for n in wanted if n not in MODULES]
    if unknown:
        raise SystemExit(f"unknown bench {unknown}; one of {MODULES}")
    render.RESULTS_DIR.mkdir(exist_ok=True)
    for name in wanted:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}", flush=True)
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        result = module.main()
        rec = record(name, result, load=load, argv=[name] if argv else [])
        path = render.RESULTS_DIR / f"{name}.json"
        path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path}", flush=True)
    for path in render.write_all():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
