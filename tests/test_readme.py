"""The README is what a newcomer reads in five minutes: short, the quickstart first, links that
resolve. Its examples (and the documentation's) run in ``tests/docs/test_examples.py``."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_the_first_code_block_trains_on_your_prompts_with_your_reward():
    lang, code = FENCE.search(README).groups()
    assert lang == "bash" and len(code.strip().splitlines()) <= 10
    assert "tq-train" in code and "task=prompts" in code and "task.path=" in code
    assert "def reward(" in code and "task.reward._target_=" in code
    assert "pretrained_path=" in code  # a local model: nothing is downloaded


def test_it_says_when_to_use_it_against_trl_verl_and_nemo_rl():
    table = README.split("## When to use it", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("|"))
    for other in ("TRL", "verl", "NeMo RL"):
        assert other in header
    assert "pick it when" in table


def test_the_set_up_commands_and_the_docs_are_named():
    assert "make run" in README and "make test" in README and "make docs" in README
    for page in ("getting-started", "concepts", "bring-your-own", "lightning", "data-plane",
                 "topologies", "configuration"):
        assert f"(docs/{page}.md)" in README, page


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_make_sweep_runs_the_dedup_sweeper_the_docs_describe():
    makefile = (ROOT / "Makefile").read_text()
    sweep = makefile.split("\nsweep:", 1)[1].split("\n\n", 1)[0]
    assert "-m hydra/sweeper=tq_dedup " in sweep


def test_make_test_runs_ruff_over_the_tree_before_the_tests():
    makefile = (ROOT / "Makefile").read_text()
    assert "\ntest: lint\n" in makefile
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "$(VENV)/bin/ruff check .\n" in lint + "\n"
    assert ",dev," in makefile.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]
