"""No code path of the package unpickles data (SECURITY.md): a source scan, and a scan of the
scanner, so the rule cannot pass by finding nothing."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("tq_plugin", "hydra_plugins", "recipes")
# Modules whose load functions execute code from the bytes they read.
UNPICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal", "joblib"}
LOADERS = {"load", "loads", "Unpickler", "open", "read_pickle"}


def _true(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unpickling_calls(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: what`` for each call that can unpickle."""
    tree = ast.parse(source, filename=filename)
    aliases: dict[str, str] = {}  # local name -> module (or module.function) it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = f"{aliases.get(func.value.id, func.value.id)}.{func.attr}"
        elif isinstance(func, ast.Name):
            target = aliases.get(func.id, func.id)
        else:
            target = ""
        module, _, name = target.rpartition(".")
        keywords = {k.arg: k.value for k in node.keywords}
        where = f"{filename}:{node.lineno}"
        if module.split(".")[0] in UNPICKLERS and name in LOADERS:
            found.append(f"{where}: {target}")
        elif target == "torch.load" and not _true(keywords.get("weights_only", ast.Constant(None))):
            found.append(f"{where}: torch.load without weights_only=True")
        elif name == "read_pickle":
            found.append(f"{where}: {target}")
        if _true(keywords.get("allow_pickle", ast.Constant(None))):
            found.append(f"{where}: allow_pickle=True")
    return found


def test_the_package_never_unpickles() -> None:
    found = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += unpickling_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.loads(b)",
    "import pickle as p\np.load(f)",
    "from pickle import loads\nloads(b)",
    "from pickle import Unpickler\nUnpickler(f).load()",
    "import cloudpickle\ncloudpickle.loads(b)",
    "import torch\ntorch.load(f)",
    "import torch\ntorch.load(f, weights_only=False)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "import pandas as pd\npd.read_pickle(f)",
])
def test_the_scan_finds_each_unpickling_call(snippet: str) -> None:
    assert len(unpickling_calls(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(f, weights_only=True)",
    "import numpy as np\nnp.load(f)",
    "import json\njson.loads(s)",
    "import pickle\npickle.dumps(x)",
])
def test_the_scan_lets_safe_calls_pass(snippet: str) -> None:
    assert unpickling_calls(snippet) == []
