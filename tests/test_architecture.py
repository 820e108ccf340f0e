"""The layering the README draws, enforced: nothing imports upward (between the packages, and
between the rooms of ``tq_plugin.rl``), no import loop anywhere, no reach into another package's
private module, modules small enough to hold in mind, and only the Ray adapter imports Ray
(transferqueue likewise).

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``. An import
hidden inside a function is still a dependency, and a loop hidden that way is still a loop."""

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
    "tq_plugin.api": 6,
    "tq_plugin.demo": 6,
}
BACKEND_ONLY = {
    "ray": {"tq_plugin.data_plane.backends.ray_cluster", "tq_plugin.data_plane.backends.ray_workers"},
    "transfer_queue": {"tq_plugin.data_plane.backends.transferqueue_service"},
}


# The rooms of tq_plugin.rl, lower number = lower room: recipe -> topology -> training ->
# models | tasks | algorithms (the last three side by side: none imports another).
RL_ROOMS = {
    "tq_plugin.rl.algorithms": 0,
    "tq_plugin.rl.models": 0,
    "tq_plugin.rl.tasks": 0,
    "tq_plugin.rl.training": 1,
    "tq_plugin.rl.topology": 2,
    "tq_plugin.rl.recipe": 3,
}
MAX_MODULE_LINES = 600
MAX_RL_TOP_MODULES = 3  # __init__, recipe and at most one more directly in tq_plugin/rl/


def _layer(module: str) -> int | None:
    for prefix, level in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def _room(module: str, rooms: dict[str, int]) -> tuple[str, int] | None:
    for prefix, level in rooms.items():
        if module == prefix or module.startswith(prefix + "."):
            return prefix, level
    return None


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it; ``from pkg import name`` counts as
    ``pkg.name`` too where ``pkg.name`` is a module of ours (``from tq_plugin.rl import x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (write the absolute name)"
            if node.module:
                out.add(node.module)
                out.update(f"{node.module}.{alias.name}" for alias in node.names
                           if f"{node.module}.{alias.name}" in _MODULE_NAMES)
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        if "conf" in path.relative_to(PKG).parts[:1]:
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


_MODULE_NAMES = {name for name, _ in _modules()}


def _own_imports(name: str, path: pathlib.Path) -> set[str]:
    """The tq_plugin modules ``name`` imports (a package import counts as its ``__init__``)."""
    return {i for i in _imports(path) if i in _MODULE_NAMES and i != name}


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


def test_no_rl_room_imports_a_higher_room():
    """Inside tq_plugin.rl: recipe -> topology -> training -> models | tasks | algorithms."""
    upward = []
    for name, path in _modules():
        own = _room(name, RL_ROOMS)
        if own is None:
            continue
        for imported in _imports(path):
            target = _room(imported, RL_ROOMS)
            if target is None or target[0] == own[0]:
                continue
            if target[1] >= own[1]:
                upward.append(f"{name} imports {imported}")
    assert not upward, "imports against the rooms' order:\n" + "\n".join(upward)


def test_nothing_imports_the_recipe():
    users = [name for name, path in _modules()
             if name not in ("tq_plugin.rl.recipe", "tq_plugin.cli")
             and any(i == "tq_plugin.rl.recipe" for i in _imports(path))]
    assert not users, f"only the CLI builds the recipe: {users}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_loop():
    """A package's ``__init__`` that re-exports its modules is an edge package -> module, so
    a module importing its own package's ``__init__`` would close a loop: import the module."""
    graph = {name: _own_imports(name, path) for name, path in _modules()}
    cycle = _cycle(graph)
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_hidden_loop():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_is_too_long():
    long = [f"{name}: {n} lines" for name, path in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"split these (over {MAX_MODULE_LINES} lines):\n" + "\n".join(long)


def test_no_reach_into_another_packages_private_module():
    """``tq_plugin.<a>`` never imports a ``_``-prefixed module of ``tq_plugin.<b>``."""
    offenders = []
    for name, path in _modules():
        top = ".".join(name.split(".")[:2])
        for imported in _imports(path):
            parts = imported.split(".")
            if (parts[0] == "tq_plugin" and ".".join(parts[:2]) != top
                    and any(p.startswith("_") and p != "__init__" for p in parts)):
                offenders.append(f"{name} imports {imported}")
    assert not offenders, "\n".join(offenders)


def test_rl_is_rooms_with_tests_of_the_same_name():
    rl = PKG / "rl"
    top = sorted(p.name for p in rl.glob("*.py"))
    assert len(top) <= MAX_RL_TOP_MODULES, f"modules directly in tq_plugin/rl/: {top}"
    rooms = sorted(p.name for p in rl.iterdir() if (p / "__init__.py").exists())
    assert rooms, "tq_plugin/rl has no sub-packages"
    assert {f"tq_plugin.rl.{r}" for r in rooms} <= set(RL_ROOMS), rooms
    missing = [r for r in rooms if not list((ROOT / "tests" / "rl" / r).glob("test_*.py"))]
    assert not missing, f"rooms without tests/rl/<room>/test_*.py: {missing}"


# A topology's name compared anywhere but in its own room (or the config schema, which only
# lists the names) is a branch the step source interface should have answered.
TOPOLOGY_NAMES = {"colocated", "disaggregated"}
TOPOLOGY_ROOM = PKG / "rl" / "topology"


def _topology_branches(tree: ast.AST) -> list[int]:
    """Lines of comparisons that involve a topology name (``"disaggregated"``) or anything
    called ``topology`` (``rc.topology == ...``, ``cfg["topology"] != ...``), and of
    ``isinstance`` checks against a step source class (``Colocated``, ``Disaggregated``)."""
    def names_topology(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Constant) and node.value in TOPOLOGY_NAMES)
                or (isinstance(node, ast.Attribute) and node.attr == "topology")
                or (isinstance(node, ast.Name) and node.id == "topology")
                or (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                    and node.slice.value == "topology"))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
                names_topology(n) for n in [node.left, *node.comparators]) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "isinstance" and len(node.args) == 2
              and any(isinstance(n, ast.Name) and n.id in {"Colocated", "Disaggregated"}
                      for n in ast.walk(node.args[1]))):
            lines.append(node.lineno)
    return lines


def test_no_topology_branch_outside_the_topology_room():
    """The recipe, the module and everything else ask the step source (``recipe.topology``'s,
    built once at setup: ``tq_plugin.rl.topology.source``), never which topology runs."""
    found = []
    for path in PKG.rglob("*.py"):
        if TOPOLOGY_ROOM in path.parents:
            continue
        for line in _topology_branches(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, "topology branches outside tq_plugin/rl/topology/:\n" + "\n".join(found)


def test_the_topology_branch_finder_finds_one():
    src = ('if rc.topology == "disaggregated": pass\n'
           'x = cfg["topology"] != "colocated"\n'
           'y = isinstance(source, Colocated)\n'
           'z = name == "disaggregated"\n')
    assert _topology_branches(ast.parse(src)) == [1, 2, 3, 4]
