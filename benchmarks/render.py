"""Render every published figure from ``benchmarks/results/<bench>.json`` (one source).

``python -m benchmarks.run_all <bench>`` writes ``benchmarks/results/<bench>.json``: the command,
the date, the machine, the load average it started under, the section's Markdown and a dict of
named key figures (``"figures"``, strings as the section prints them). This module builds from
those files, and from nothing else:

- ``benchmarks/RESULTS.md``: a title, a preamble and each bench's section followed by its
  ``_Measured <date>._`` line, in ``SECTIONS`` order (benches not listed there follow, by name);
- the headline tables of ``README.md`` and ``docs/benchmarks.md`` (between the
  ``<!-- headline:start -->`` / ``<!-- headline:end -->`` markers), from the rows in
  ``benchmarks/headline.py``, whose ``{bench.figure}`` fields name key figures.

``python -m benchmarks.render`` writes the three documents; ``--check`` writes nothing and exits 1
listing every difference (the document, the section or row, the figure). ``tests/test_figures.py``
runs the same check. A bench re-measured alone rewrites its own JSON file only, so rendering never
reverts another bench's section.
"""

from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
RESULTS_DIR = HERE / "results"
RESULTS_MD = HERE / "RESULTS.md"
README = ROOT / "README.md"
DOCS_BENCHMARKS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"

# The order of the sections in RESULTS.md; a bench missing here is placed after them, by name.
SECTIONS = ["bench_data_plane", "bench_backends", "bench_packing", "bench_lightning",
            "bench_staging", "bench_durable", "bench_topology", "bench_inflight", "bench_fleet", "bench_engines",
            "bench_agent_endpoint",
            "bench_fsdp", "soak", "reliability", "async_resume", "bench_logprobs",
            "bench_real_shapes", "bench_real_lengths", "bench_parity", "bench_toy_steps",
            "bench_real_model", "bench_real_extra", "bench_lora"]

TITLE = "# Benchmark results"
PREAMBLE = ("Every figure is the median (min–max) of repeated runs unless it says otherwise; "
            "every ratio compares figures taken in the same run, interleaved.")
REQUIRED = {"bench": str, "command": str, "date": str, "machine": str, "markdown": str,
            "figures": dict}
_FIELD = re.compile(r"\{(\w+)\.(\w+)\}")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


class FigureError(ValueError):
    """A results file or a headline row that cannot be rendered (names the file and field)."""


def load_results(directory: pathlib.Path | None = None) -> dict[str, dict[str, Any]]:
    """Every ``<bench>.json`` under ``directory`` (``RESULTS_DIR``), checked: the keys of
    ``REQUIRED`` with their types, ``bench`` equal to the file's name, every figure a string
    found in the section."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((directory or RESULTS_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        for key, kind in REQUIRED.items():
            if not isinstance(record.get(key), kind):
                raise FigureError(f"{path}: {key!r} must be a {kind.__name__}, "
                                  f"got {type(record.get(key)).__name__}")
        if record["bench"] != path.stem:
            raise FigureError(f"{path}: 'bench' is {record['bench']!r}, the file is {path.stem}")
        for name, value in record["figures"].items():
            if not isinstance(value, str) or not value:
                raise FigureError(f"{path}: figure {name!r} must be a non-empty string")
            if value not in record["markdown"]:
                raise FigureError(f"{path}: figure {name!r} = {value!r} is not in its section's "
                                  "markdown (a key figure must be one the section prints)")
        out[path.stem] = record
    return out


def ordered(results: Mapping[str, dict[str, Any]]) -> list[str]:
    known = [b for b in SECTIONS if b in results]
    return known + sorted(b for b in results if b not in SECTIONS)


def section_text(record: Mapping[str, Any]) -> str:
    return f"{record['markdown'].strip()}\n\n_Measured {record['date']}._"


def render_results(results: Mapping[str, dict[str, Any]]) -> str:
    """The whole of ``RESULTS.md``; the machine line is the most recently measured section's."""
    if not results:
        raise FigureError(f"no results under {RESULTS_DIR}")
    latest = max(results.values(), key=lambda r: r["date"])
    parts = [TITLE, f"Written by `make bench` on: {latest['machine']}.", PREAMBLE,
             *(section_text(results[b]) for b in ordered(results))]
    return "\n\n".join(parts) + "\n"


def fill(template: str, results: Mapping[str, dict[str, Any]], where: str) -> str:
    """``template`` with each ``{bench.figure}`` replaced by that key figure."""
    def one(m: re.Match[str]) -> str:
        bench, name = m.groups()
        if bench not in results:
            raise FigureError(f"{where}: {{{bench}.{name}}} names a bench with no "
                              f"benchmarks/results/{bench}.json")
        figures = results[bench]["figures"]
        if name not in figures:
            raise FigureError(f"{where}: {{{bench}.{name}}}: benchmarks/results/{bench}.json has "
                              f"no figure {name!r} (it has {sorted(figures)}); the bench's main() "
                              "must return it under 'key_figures'")
        return figures[name]
    return _FIELD.sub(one, template)


def render_headline(rows: Sequence[Sequence[str]], headers: Sequence[str],
                    results: Mapping[str, dict[str, Any]], where: str) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    for row in rows:
        if len(row) != len(headers):
            raise FigureError(f"{where}: row {row[0][:40]!r} has {len(row)} cells, "
                              f"the table {len(headers)}")
        lines.append("| " + " | ".join(fill(c, results, where) for c in row) + " |")
    return "\n".join(lines)


def headlines(results: Mapping[str, dict[str, Any]]) -> dict[pathlib.Path, str]:
    from benchmarks import headline

    return {
        README: render_headline(headline.README, ("what", "measured"), results,
                                "benchmarks/headline.py README"),
        DOCS_BENCHMARKS: render_headline(headline.DOCS, ("what", "measured", "target"), results,
                                         "benchmarks/headline.py DOCS"),
    }


def splice(text: str, table: str, path: pathlib.Path) -> str:
    """``text`` with the block between the headline markers replaced by ``table``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise FigureError(f"{path}: needs {START} and {END} around its headline table")
    return text[: start + len(START)] + "\n" + table + "\n" + text[end:]


def block(text: str) -> str:
    start, end = text.find(START), text.find(END)
    return text[start + len(START): end].strip() if 0 <= start < end else ""


def _rel(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _figure_diffs(have: str, want: str) -> list[str]:
    """The numbers that differ between two versions of a line or row, as 'X where ... has Y'."""
    a, b = _NUMBER.findall(have), _NUMBER.findall(want)
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            out.append(f"{' '.join(a[i1:i2]) or '(nothing)'} where the source has "
                       f"{' '.join(b[j1:j2]) or '(nothing)'}")
    return out


def _line_diffs(have: str, want: str) -> list[tuple[str, str]]:
    """Pairs (document line, rendered line) of the lines that differ."""
    ha, wa = have.splitlines(), want.splitlines()
    pairs = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ha, b=wa, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        old, new = ha[i1:i2], wa[j1:j2]
        for k in range(max(len(old), len(new))):
            pairs.append((old[k] if k < len(old) else "", new[k] if k < len(new) else ""))
    return pairs


def _describe(doc: str, context: str, have: str, want: str) -> list[str]:
    problems = []
    for old, new in _line_diffs(have, want):
        figures = _figure_diffs(old, new)
        what = "; ".join(figures) if figures else "text differs"
        problems.append(f"{doc}, {context}: {what}\n    document: {old[:300]}\n"
                        f"    source:   {new[:300]}")
    return problems


def _sections(text: str) -> list[str]:
    """A RESULTS.md's sections, each ending with its ``_Measured`` line."""
    out, start = [], text.find("\n#", 1) + 1
    for m in re.finditer(r"^_Measured [^\n]*$", text, re.MULTILINE):
        out.append(text[start:m.end()].strip())
        start = m.end()
    return out


def check(results: Mapping[str, dict[str, Any]] | None = None, *,
          documents: Mapping[pathlib.Path, str] | None = None) -> list[str]:
    """Every difference between the three documents and what ``results`` renders, each naming
    the document, the section (and its results file) or headline row, and the figures."""
    results = load_results() if results is None else results
    docs = dict(documents) if documents is not None else {
        p: p.read_text() for p in (RESULTS_MD, README, DOCS_BENCHMARKS)}
    problems: list[str] = []
    have = docs[RESULTS_MD]
    want = render_results(results)
    if have != want:
        doc = _rel(RESULTS_MD)
        by_heading = {_heading(s): s for s in _sections(have)}
        for bench in ordered(results):
            fresh = section_text(results[bench])
            old = by_heading.pop(_heading(fresh), None)
            context = (f"section {_heading(fresh)!r} (source benchmarks/results/{bench}.json, "
                       f"'markdown')")
            if old is None:
                problems.append(f"{doc}: {context} is missing")
            elif old != fresh:
                problems += _describe(doc, context, old, fresh)
        problems += [f"{doc}: section {h!r} has no benchmarks/results/*.json" for h in by_heading]
        head_have, head_want = have[: have.find("\n#", 1)], want[: want.find("\n#", 1)]
        if head_have != head_want:
            problems += _describe(doc, "title and preamble (benchmarks/render.py)",
                                  head_have, head_want)
        if not problems:
            problems.append(f"{doc}: differs from the rendering in whitespace or order")
    for path, table in headlines(results).items():
        doc, text = _rel(path), docs[path]
        if START not in text or END not in text:
            problems.append(f"{doc}: no {START} / {END} markers around the headline table")
            continue
        if block(text) != table:
            rows = "headline table (source benchmarks/headline.py and benchmarks/results/)"
            problems += _describe(doc, rows, block(text), table)
    return problems


def _heading(section: str) -> str:
    return section.strip().splitlines()[0].strip()


def write_all(results: Mapping[str, dict[str, Any]] | None = None) -> list[pathlib.Path]:
    """Write RESULTS.md and the two headline tables; returns the paths that changed."""
    results = load_results() if results is None else results
    changed = []
    text = render_results(results)
    if not RESULTS_MD.exists() or RESULTS_MD.read_text() != text:
        RESULTS_MD.write_text(text)
        changed.append(RESULTS_MD)
    for path, table in headlines(results).items():
        old = path.read_text()
        new = splice(old, table, path)
        if new != old:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; list every difference and exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) if problems else "every figure matches its source")
        return 1 if problems else 0
    for path in write_all():
        print(f"wrote {_rel(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
