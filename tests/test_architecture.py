"""The layering the README draws, enforced: nothing imports upward, and only the Ray adapter
imports Ray (transferqueue likewise, should an adapter for it arrive)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "tq_plugin"

# Lower number = lower layer. A module may import its own layer or any lower one.
LAYERS = {
    "tq_plugin.config": 0,
    "tq_plugin.data_plane": 1,
    "tq_plugin.staging": 2,
    "tq_plugin.lightning": 3,
    "tq_plugin.rollout": 4,
    "tq_plugin.rl": 5,
    "tq_plugin.cli": 6,
    "tq_plugin.demo": 6,
}
BACKEND_ONLY = {
    "ray": {"tq_plugin.data_plane.backends.ray_actor", "tq_plugin.data_plane.backends.transferqueue",
            "tq_plugin.data_plane.backends.ray_workers"},
    "transfer_queue": {"tq_plugin.data_plane.backends.transferqueue"},
}


def _layer(module: str) -> int | None:
    for prefix, level in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        if "conf" in path.relative_to(PKG).parts[:1]:
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


def test_no_module_imports_a_higher_layer():
    upward = []
    for name, path in _modules():
        own = _layer(name)
        if own is None:
            continue
        for imported in _imports(path):
            target = _layer(imported)
            if target is not None and target > own:
                upward.append(f"{name} imports {imported}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_only_the_adapter_imports_ray_or_transferqueue():
    offenders = []
    for name, path in _modules():
        for imported in _imports(path):
            top = imported.split(".")[0]
            if top in BACKEND_ONLY and name not in BACKEND_ONLY[top]:
                offenders.append(f"{name} imports {imported}")
    assert not offenders, "\n".join(offenders)


def test_the_layer_map_covers_every_subpackage():
    unmapped = sorted({n for n, _ in _modules() if n != "tq_plugin" and _layer(n) is None})
    assert not unmapped, f"add these to LAYERS (and to the README's picture): {unmapped}"


def test_package_exports_are_listed_explicitly():
    """Every public package lists its exports; no ``import *``, no private names exported."""
    import importlib

    problems = []
    for package in ("tq_plugin.data_plane", "tq_plugin.staging", "tq_plugin.lightning"):
        module = importlib.import_module(package)
        source = (ROOT / package.replace(".", "/") / "__init__.py").read_text()
        if "import *" in source:
            problems.append(f"{package} uses import *")
        exported = list(getattr(module, "__all__", []))
        problems += [f"{package} exports missing {n}" for n in exported if not hasattr(module, n)]
        problems += [f"{package} exports private {n}" for n in exported if n.startswith("_")]
        if len(set(exported)) != len(exported):
            problems.append(f"{package} lists a name twice in __all__")
    assert not problems, "\n".join(problems)
