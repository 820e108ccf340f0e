"""Every code example in the README and the documentation runs, as written (a stale page is a bug).

The examples are collected from the Markdown itself:

* a ```` ```python ```` block is executed in-process (fast tier);
* a ```` ```bash ```` block is run with bash in a folder of its own per page (slow tier), with
  ``tq-train`` shrunk to a few RL steps: a shim on ``PATH`` appends ``recipe.num_steps=2`` (or
  keeps the page's value when it is at most 6), ``recipe.prompts_per_step=4`` and no progress bar;
* a block titled with its file name, ```` ```python title="my_app.py" ```` (the site shows the
  title above the code), is written to that path in the page's folder instead (``my_app.py``,
  ``config.yaml``, ``prompts.jsonl``), before any of the page's blocks runs. The older
  ``<!-- file: PATH -->`` on the line before a block does the same but hides the name from the
  reader: :func:`test_files_are_named_where_the_reader_sees_it` refuses it;
* ``<!-- no-run: why -->`` on the line before a block skips it; the reason is required and the
  marker is kept for what cannot run here (installs, the set-up commands, vLLM's minute-long
  start): :func:`test_no_run_markers_are_few` bounds them.

A block in a code language (python, bash, yaml, json, ...) without one of these is an example
that must run; output blocks are ```` ```text ```` (or no language) and are not run. Blocks of one
page share its folder and run in page order (the tiny model a page makes is there for its next
block).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "SECURITY.md",
                *(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)])
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
# Languages of code a reader would run or save; anything else is output or a picture.
CODE = PYTHON | SHELL | {"yaml", "yml", "json", "jsonl", "toml", "ini"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)([^\n]*)$")
MARKER = re.compile(r"^\s*<!--\s*(no-run|file)\s*:\s*(.*?)\s*-->\s*$")
# A fence's title (pymdownx.highlight: ```python title="my_app.py"): the file the block is.
TITLE = re.compile(r"""\btitle=(?:"([^"]*)"|'([^']*)')""")
# At most this many no-run markers in all, and at most this share of the examples.
MAX_NO_RUN = 5
MAX_NO_RUN_SHARE = 0.2
# The shim's cap: a page's own recipe.num_steps up to this is kept (a resume needs its steps).
KEEP_STEPS = 6


@dataclass(frozen=True)
class Block:
    page: Path
    index: int
    line: int
    lang: str
    code: str
    marker: str | None  # "no-run" | "file" | None
    arg: str  # the marker's reason or path
    hidden: bool = False  # the path is in an HTML comment (<!-- file: PATH -->), not a title

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, with the marker on the last non-blank line before each."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.group(1), opening.group(2), opening.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$",
                                              lines[j]):
            body.append(lines[j].removeprefix(indent))
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before)
        title = TITLE.search(opening.group(4))
        kind, arg = (marker.group(1), marker.group(2)) if marker else (None, "")
        if title and not marker:
            kind, arg = "file", (title.group(1) or title.group(2) or "").strip()
        out.append(Block(page, len(out), i + 1, lang, textwrap.dedent("\n".join(body)) + "\n",
                         kind, arg, hidden=bool(marker and kind == "file")))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if b.marker is None and b.lang in PYTHON | SHELL]


def _param(block: Block):
    marks = [pytest.mark.slow, pytest.mark.timeout(900)] if block.lang in SHELL else []
    return pytest.param(block, id=block.name, marks=marks)


# ------------------------------------------------------------------------- the rules
def test_examples_are_collected():
    names = {b.page.name for b in RUN}
    assert {"README.md", "getting-started.md", "concepts.md", "lightning.md",
            "configuration.md"} <= names, names
    assert sum(b.lang in PYTHON for b in RUN) >= 5 and sum(b.lang in SHELL for b in RUN) >= 10


def test_every_code_block_runs_or_says_why_not():
    silent = [b.name for b in ALL if b.lang in CODE and b.marker is None
              and b.lang not in PYTHON | SHELL]
    assert not silent, (f"{silent}: a {{yaml, json, ...}} block is saved as a file (```yaml "
                        "title=\"PATH\"), or skipped with <!-- no-run: why --> before it")
    unknown = [b.name for b in ALL if b.marker == "file" and not b.arg]
    assert not unknown, f"{unknown}: a file block's title=\"PATH\" needs a path"


def test_files_are_named_where_the_reader_sees_it():
    hidden = [b.name for b in ALL if b.hidden]
    assert not hidden, (f"{hidden}: name the file in the fence, ```python title=\"PATH\", which "
                        "the site shows above the code (an HTML comment shows nothing)")


def test_no_run_markers_are_few():
    skipped = [b for b in ALL if b.marker == "no-run"]
    assert all(len(b.arg) >= 10 for b in skipped), [b.name for b in skipped if len(b.arg) < 10]
    examples = len(RUN) + len(skipped)
    assert len(skipped) <= MAX_NO_RUN, [f"{b.name}: {b.arg}" for b in skipped]
    assert len(skipped) <= MAX_NO_RUN_SHARE * examples, (len(skipped), examples)


# ---------------------------------------------------------------------- running them
_DIRS: dict[Path, Path] = {}
_DONE: dict[str, str] = {}  # code already run -> where


def _page_dir(page: Path, factory: pytest.TempPathFactory) -> Path:
    if page not in _DIRS:
        work = factory.mktemp(page.stem.replace(".", "_"))
        for b in blocks(page):
            if b.marker == "file":
                target = work / b.arg
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(b.code)
        (work / "recipes").symlink_to(ROOT / "recipes")
        _DIRS[page] = work
    return _DIRS[page]


SHIM = """#!{python}
# tq-train for the documentation's examples: the page's command, a few RL steps long.
import re
import sys

args = sys.argv[1:]
steps = [a for a in args if re.fullmatch(r"recipe\\.num_steps=\\d+", a)]
if not steps or int(steps[-1].split("=")[1]) > {keep}:
    args.append("recipe.num_steps=2")
args += ["recipe.prompts_per_step=4", "trainer.enable_progress_bar=false"]
sys.argv = [sys.argv[0], *args]  # DDP ranks re-run this file with these arguments

from tq_plugin.cli import main

main()
"""


def _shell_env(work: Path) -> dict[str, str]:
    bin_dir = work / ".bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        shim = bin_dir / "tq-train"
        shim.write_text(SHIM.format(python=sys.executable, keep=KEEP_STEPS))
        shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                   env.get("PATH", "")])
    return env


@pytest.mark.parametrize("block", [_param(b) for b in RUN])
def test_example_runs(block: Block, tmp_path_factory, monkeypatch):
    work = _page_dir(block.page, tmp_path_factory)
    if block.code in _DONE:
        return  # the same example already ran (the quickstart is on two pages)
    if block.lang in PYTHON:
        monkeypatch.chdir(work)
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        exec(compile(block.code, block.name, "exec"), {"__name__": "docs_example"})  # noqa: S102
    else:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=work,
                              env=_shell_env(work), capture_output=True, text=True,
                              timeout=850, check=False)
        assert proc.returncode == 0, (f"{block.name} exited {proc.returncode}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    _DONE[block.code] = block.name
