"""Every published figure comes from one source: ``benchmarks/results/<bench>.json``.

``benchmarks/RESULTS.md`` and the headline tables of ``README.md`` and ``docs/benchmarks.md``
must equal what ``benchmarks/render.py`` renders from the results files; a difference fails
naming the document, the section or row and the figure. Documents may cite only benchmark
scripts that exist.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import sys
import types

import pytest

from benchmarks import render, run_all

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_document_matches_its_results_files() -> None:
    problems = render.check()
    assert not problems, ("documents differ from benchmarks/results/*.json (run "
                          "`python -m benchmarks.render`, or fix the source):\n"
                          + "\n".join(problems))


def _documents() -> dict[pathlib.Path, str]:
    return {p: p.read_text() for p in (render.RESULTS_MD, render.README, render.DOCS_BENCHMARKS)}


def test_a_figure_changed_in_its_source_is_named_with_each_document() -> None:
    results = copy.deepcopy(render.load_results())
    staging = results["bench_staging"]
    old = staging["figures"]["pipeline_calls_s"]
    first = render._NUMBER.search(old).group()
    bumped = str((int(first[0]) % 9) + 1) + first[1:]  # another leading digit, same shape
    new = old.replace(first, bumped, 1)
    staging["markdown"] = staging["markdown"].replace(old, new)
    staging["figures"]["pipeline_calls_s"] = new
    problems = "\n".join(render.check(results, documents=_documents()))
    for doc in ("benchmarks/RESULTS.md", "README.md", "docs/benchmarks.md"):
        assert f"{doc}," in problems
    assert "section '### Token staging' (source benchmarks/results/bench_staging.json" in problems
    assert f"{first} where the source has {bumped}" in problems


def test_a_figure_changed_in_a_document_by_hand_is_named() -> None:
    docs = _documents()
    docs[render.README] = docs[render.README].replace("| 1.8% |", "| 1.7% |", 1)
    results_md = docs[render.RESULTS_MD]
    assert "| 1.8% (accounted) |" in results_md
    docs[render.RESULTS_MD] = results_md.replace("| 1.8% (accounted) |", "| 1.6% (accounted) |", 1)
    problems = render.check(documents=docs)
    assert any(p.startswith("README.md, headline table") and "1.7 where the source has 1.8" in p
               for p in problems), problems
    assert any(p.startswith("benchmarks/RESULTS.md, section '## Lightning integration")
               and "1.6 where the source has 1.8" in p for p in problems), problems
    assert len(problems) == 2, problems


def test_a_key_figure_the_section_does_not_print_is_refused(tmp_path: pathlib.Path) -> None:
    record = json.loads((render.RESULTS_DIR / "bench_lightning.json").read_text())
    record["figures"]["overhead"] = "1.9%"
    (tmp_path / "bench_lightning.json").write_text(json.dumps(record))
    with pytest.raises(render.FigureError, match=r"bench_lightning.json: figure 'overhead' = "
                                                 r"'1.9%' is not in its section"):
        render.load_results(tmp_path)
    record["bench"] = "bench_other"
    (tmp_path / "bench_lightning.json").write_text(json.dumps(record))
    with pytest.raises(render.FigureError, match="'bench' is 'bench_other'"):
        render.load_results(tmp_path)


def test_a_headline_field_without_its_figure_names_the_bench_and_figure() -> None:
    results = copy.deepcopy(render.load_results())
    del results["bench_lightning"]["figures"]["overhead"]
    with pytest.raises(render.FigureError, match=r"\{bench_lightning.overhead\}.*no figure "
                                                 r"'overhead'"):
        render.headlines(results)


def _copy_tree(tmp: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The results files and the three documents under ``tmp``, render pointed at them."""
    (tmp / "results").mkdir()
    for path in render.RESULTS_DIR.glob("*.json"):
        (tmp / "results" / path.name).write_text(path.read_text())
    for name, path in {"RESULTS_MD": render.RESULTS_MD, "README": render.README,
                       "DOCS_BENCHMARKS": render.DOCS_BENCHMARKS}.items():
        (tmp / path.name).write_text(path.read_text())
        monkeypatch.setattr(render, name, tmp / path.name)
    monkeypatch.setattr(render, "RESULTS_DIR", tmp / "results")


def test_a_partial_run_rewrites_its_own_section_and_keeps_every_other(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _copy_tree(tmp_path, monkeypatch)
    before = render.RESULTS_MD.read_text()
    old_record = render.load_results()["bench_lightning"]
    old_lightning = render.section_text(old_record)
    figures = {**old_record["figures"], "overhead": "1.6%"}
    fresh = old_lightning.split("\n\n_Measured")[0].replace("| 2.614 | 1.8%", "| 2.614 | 1.6%")
    fake = types.ModuleType("benchmarks.bench_lightning")
    fake.main = lambda: {"markdown": fresh, "key_figures": figures}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.bench_lightning", fake)
    run_all.main(["bench_lightning"])
    after = render.RESULTS_MD.read_text()
    record = json.loads((render.RESULTS_DIR / "bench_lightning.json").read_text())
    assert record["command"] == "python -m benchmarks.run_all bench_lightning"
    assert record["figures"] == figures
    assert record["markdown"] == fresh and record["machine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", record["date"])
    others = [s for s in render._sections(before) if not s.startswith("## Lightning")]
    assert others == [s for s in render._sections(after) if not s.startswith("## Lightning")]
    assert fresh in after and old_lightning not in after
    assert "| Lightning callback + mixin overhead per training step | 1.6% |" in (
        render.README.read_text())
    assert render.check() == []


def test_run_all_refuses_a_key_figure_its_section_does_not_print() -> None:
    with pytest.raises(ValueError, match=r"bench_x: key figures not printed.*'a': '9.9'"):
        run_all.key_figures("bench_x", {"markdown": "1.0", "key_figures": {"a": "9.9"}}, "1.0",
                            None)


_SCRIPT = re.compile(r"benchmarks/(\w+\.py)")
_MODULE = re.compile(r"(?<![/\w])benchmarks\.(?!md\b)(\w+)")
_RUN_ALL = re.compile(r"benchmarks\.run_all((?: +[\w<>]+)+)")  # bench_<name>: a placeholder


def _texts() -> list[pathlib.Path]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), render.RESULTS_MD,
             *sorted(render.RESULTS_DIR.glob("*.json")), ROOT / "Makefile"]
    for top in ("tests", "tq_plugin", "benchmarks", "recipes"):
        paths += sorted((ROOT / top).rglob("*.py"))
    return [p for p in paths if p.is_file()]


def test_every_cited_benchmark_script_exists() -> None:
    missing = []
    for path in _texts():
        text = path.read_text()
        for m in _SCRIPT.finditer(text):
            if not (ROOT / "benchmarks" / m.group(1)).exists():
                missing.append(f"{path.relative_to(ROOT)}: benchmarks/{m.group(1)}")
        for m in _MODULE.finditer(text):
            if not (ROOT / "benchmarks" / f"{m.group(1)}.py").exists():
                missing.append(f"{path.relative_to(ROOT)}: benchmarks.{m.group(1)}")
        for m in _RUN_ALL.finditer(text):
            for name in m.group(1).split():
                cited = "<" not in name and name.startswith("bench") or name in ("soak", "reliability",
                                                              "async_resume")
                if cited and name not in run_all.MODULES:
                    missing.append(f"{path.relative_to(ROOT)}: run_all {name} (not in "
                                   "run_all.MODULES)")
    assert not missing, "cited benchmark scripts that do not exist:\n" + "\n".join(missing)
