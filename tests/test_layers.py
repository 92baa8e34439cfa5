"""The code's layers point one way, and a module's underscore names stay its own.

Read from the source with `ast`, nothing imported, imports inside functions included:

- research builds on nothing of reviews (reviews reacts to research.signals and serves
  its own fragments);
- no module imports another's `_private` name, by `from m import _x` or as `m._x`;
- nothing imports research.tasks: the tasks import the services, and the services send
  tasks by name (research.queueing), so there is no circle through them;
- the modules import each other without a circle when they are loaded.

Every import names its module in full, so nothing escapes these checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("research", "reviews", "webhooks", "config", "runners", "workspace")


def _sources() -> dict[str, str]:
    """Module name -> source, for every module of PACKAGES (migrations are generated)."""
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts:
                parts = path.relative_to(ROOT).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                sources[name] = path.read_text(encoding="utf-8")
    return sources


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(tree: ast.Module, known: set[str]) -> list[tuple[str, str, int, bool]]:
    """(imported module, name taken from it or "", line, at load time) for each import
    of the project; "at load time" is False inside a function. A relative import is
    returned as module "." (the project names its modules in full)."""
    found = []

    def visit(node: ast.AST, loading: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _for_type_checkers_only(child):
                # `if TYPE_CHECKING:` never runs: its imports are for annotations alone.
                visit(ast.Module(body=child.body, type_ignores=[]), False)
                visit(ast.Module(body=child.orelse, type_ignores=[]), loading)
                continue
            inner = loading and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, "", child.lineno, loading) for alias in child.names
                             if alias.name.split(".")[0] in PACKAGES)
            elif isinstance(child, ast.ImportFrom) and child.level:
                found.append((".", "", child.lineno, loading))
            elif isinstance(child, ast.ImportFrom) and child.module.split(".")[0] in PACKAGES:
                for alias in child.names:
                    submodule = f"{child.module}.{alias.name}"
                    found.append((submodule, "", child.lineno, loading) if submodule in known
                                 else (child.module, alias.name, child.lineno, loading))
            visit(child, inner)

    visit(tree, True)
    return found


def _for_type_checkers_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_aliases(tree: ast.Module, known: set[str]) -> dict[str, str]:
    """Local name -> project module, for names bound to a whole module."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                        else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def layer_violations(sources: dict[str, str]) -> list[str]:
    """Every break of the rules in this module's docstring, as readable lines."""
    known = set(sources)
    problems = []
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for module, source in sources.items():
        tree = ast.parse(source)
        for imported, name, line, loading in _imports(tree, known):
            where = f"{module}:{line}"
            if imported == ".":
                problems.append(f"{where} a relative import: name the module in full")
            if module.split(".")[0] == "research" and imported.split(".")[0] == "reviews":
                problems.append(f"{where} research imports {imported} (reviews builds on research)")
            if name and _is_private(name) and imported != module:
                problems.append(f"{where} imports {imported}.{name}, a private name")
            if imported == "research.tasks" or (imported == "research" and name == "tasks"):
                problems.append(f"{where} imports research.tasks (send tasks by name: research.queueing)")
            if loading and imported in known and imported != module:
                graph[module].add(imported)
        aliases = _module_aliases(tree, known)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and aliases.get(node.value.id, module) != module and _is_private(node.attr):
                problems.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}, "
                                "a private name")
    problems.extend(f"import circle at load time: {' -> '.join(cycle)}" for cycle in _cycles(graph))
    return list(dict.fromkeys(problems))  # two names of one import line: one problem


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that is on one (a depth-first search)."""
    cycles, state = [], {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = "open"
        for neighbour in sorted(graph.get(node, ())):
            if state.get(neighbour) == "open":
                cycles.append(path[path.index(neighbour):] + [node, neighbour] if neighbour in path
                              else [node, neighbour])
            elif neighbour not in state:
                walk(neighbour, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return cycles


def test_the_code_keeps_its_layers_and_its_private_names():
    assert layer_violations(_sources()) == []


# Each rule, shown to catch what it is for: the check above could not pass by reading nothing.

def test_research_importing_reviews_is_caught_even_inside_a_function():
    sources = {"research.sweeps": "def f():\n    from reviews.live import publish_queue_changed\n",
               "reviews.live": "def publish_queue_changed(): ...\n"}
    assert layer_violations(sources) == [
        "research.sweeps:2 research imports reviews.live (reviews builds on research)"]


def test_reviews_importing_research_is_allowed():
    sources = {"reviews.live": "from research import signals\n", "research.signals": "x = 1\n"}
    assert layer_violations(sources) == []


def test_a_private_name_taken_from_another_module_is_caught_both_ways():
    sources = {"research.agents": "from research import sweeps\nfrom research.candidates import _geomean\n"
                                  "sweeps._sweep_stop(None, 'x')\nsweeps.__name__\n",
               "research.sweeps": "def _sweep_stop(sweep, reason): ...\n",
               "research.candidates": "def _geomean(values): ...\n"}
    assert layer_violations(sources) == [
        "research.agents:2 imports research.candidates._geomean, a private name",
        "research.agents:3 uses research.sweeps._sweep_stop, a private name"]


def test_a_relative_import_is_refused_rather_than_left_unread():
    assert layer_violations({"research.sweeps": "from .candidates import _geomean\n"}) == [
        "research.sweeps:1 a relative import: name the module in full"]


def test_importing_the_tasks_is_caught_and_a_load_time_circle_is_named():
    sources = {"research.candidates": "def send():\n    from research.tasks import evaluate_candidate\n",
               "research.tasks": "from research import candidates\n",
               "research.sweeps": "from research import agents\n",
               "research.agents": "from research import sweeps\n"}
    assert layer_violations(sources) == [
        "research.candidates:2 imports research.tasks (send tasks by name: research.queueing)",
        "import circle at load time: research.agents -> research.sweeps -> research.agents"]


def test_an_import_for_type_checkers_only_makes_no_load_time_circle():
    typed = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from research.sweeps import Sweep\n"
             "else:\n    from research import sweeps\n")
    sources = {"research.agents": typed, "research.sweeps": "from research import agents\nclass Sweep: ...\n"}
    # The else branch runs at load time, and closes a circle; the TYPE_CHECKING branch never runs.
    assert layer_violations(sources) == [
        "import circle at load time: research.agents -> research.sweeps -> research.agents"]
    sources["research.agents"] = typed.split("else:")[0]
    assert layer_violations(sources) == []
