"""The library's import directions (docs/architecture.md): each module imports only its own
layer or a lower one, layer-10 packages (integrations, server) never import each other, the
library never imports kvgraft.cli or click, no import cycle, and no test helper shadows a
library module by name.

Read from the source with ast, not by importing: every import statement counts, including
those inside functions and under `if TYPE_CHECKING:`, since a lazy import is still a
dependency (it only moves the failure to the call)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The repository's folders and the import names they install as (pyproject.toml).
SOURCES = {"registry": "kvgraft", "cli": "kvgraft.cli"}

# The layer table, lowest first: the one copy the test checks against (docs/architecture.md
# shows it). Keys are what follows "kvgraft." in a module's name, up to the first dot. ""
# is the package root: Python runs it before any kvgraft module, so it stays at layer 0 (a
# re-export of kvgraft.client there would load the whole library on `import kvgraft.errors`).
LAYERS: dict[str, int] = {
    "": 0, "errors": 0, "digest": 0, "strictjson": 0, "resources": 0, "fsutil": 0,
    "reference": 0, "tokens": 0, "config": 0, "configfile": 0,
    "identity": 1,
    "formats": 2, "codecs": 2,
    "blobstore": 3, "catalog": 3,
    "transfer": 4,
    "provenance": 5,
    "remote": 6,
    "services": 7,
    "client": 8,
    "oci": 9,
    "integrations": 10, "server": 10,
    "cli": 11,
}
# Packages of one layer that must not depend on each other either.
INDEPENDENT = {frozenset({"integrations", "server"})}
# Third-party names only the CLI may import.
CLI_ONLY = {"click"}


@dataclass(frozen=True)
class Import:
    importer: str  # kvgraft module name
    imported: str  # kvgraft module name, or a third-party top-level name
    where: str  # path:line


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rel = path.relative_to(ROOT / folder).with_suffix("").parts
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join((SOURCES[folder], *rel))


def library_files() -> dict[str, Path]:
    files = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            files[module_name(path)] = path
    return files


def is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def resolve(node: ast.ImportFrom, importer: str, modules: dict[str, Path]) -> list[str]:
    """The modules a `from X import a, b` depends on: X.a where that is a module, else X."""
    base = node.module or ""
    if node.level:  # relative: strip one package level per dot past the first
        package = importer if is_package(importer, modules) else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name if name in modules else base for name in names]


def imports_of(name: str, source: str, shown: str, modules: dict[str, Path]) -> list[Import]:
    """Every import in source (the module `name`, shown as `shown` in messages), wherever it
    stands: top level, function bodies, `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(source, filename=shown)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = resolve(node, name, modules)
        else:
            continue
        where = f"{shown}:{node.lineno}"
        for target in dict.fromkeys(targets):
            if target == "kvgraft" or target.startswith("kvgraft."):
                # `import kvgraft.a.b.C` cannot happen; `import kvgraft.a.b` depends on a.b.
                found.append(Import(name, target, where))
            else:
                found.append(Import(name, target.partition(".")[0], where))
    return found


def all_imports() -> tuple[dict[str, Path], list[Import]]:
    modules = library_files()
    found = [imp for name, path in modules.items()
             for imp in imports_of(name, path.read_text(), str(path.relative_to(ROOT)), modules)]
    return modules, found


def area(name: str) -> str:
    """The layer-table key of a kvgraft module: kvgraft.remote.http -> remote."""
    return name.removeprefix("kvgraft").removeprefix(".").partition(".")[0]


def layer_problem(imp: Import, modules: dict[str, Path]) -> str | None:
    if not imp.imported.startswith("kvgraft"):
        if imp.imported in CLI_ONLY and area(imp.importer) != "cli":
            return (f"{imp.where}: {imp.importer} imports {imp.imported}, which only kvgraft.cli "
                    f"may use: raise a RegistryError and let the CLI's error boundary turn it "
                    f"into output, or move the code into cli/")
        return None
    if imp.imported not in modules:
        return (f"{imp.where}: {imp.importer} imports {imp.imported}, which is no module of "
                f"registry/ or cli/: fix the name")
    mine, theirs = area(imp.importer), area(imp.imported)
    for key in (mine, theirs):
        if key not in LAYERS:
            return (f"{imp.where}: kvgraft.{key} has no layer: add it to LAYERS in "
                    f"tests/test_architecture.py and to the table in docs/architecture.md")
    if frozenset({mine, theirs}) in INDEPENDENT and mine != theirs:
        return (f"{imp.where}: {imp.importer} imports {imp.imported}, but kvgraft.{mine} and "
                f"kvgraft.{theirs} must not depend on each other: move what both need down "
                f"into a layer below {LAYERS[mine]}")
    if LAYERS[theirs] > LAYERS[mine]:
        return (f"{imp.where}: {imp.importer} (layer {LAYERS[mine]}, {mine or 'package root'}) "
                f"imports {imp.imported} (layer {LAYERS[theirs]}, {theirs}), a higher layer: "
                f"move what it uses from {imp.imported} down to layer {LAYERS[mine]} or lower, "
                f"or have the caller in layer {LAYERS[theirs]}+ pass it in (a Protocol "
                f"defined at layer {LAYERS[mine]} or lower types the parameter)")
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), or with a
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_modules_import_only_their_own_layer_or_lower() -> None:
    modules, found = all_imports()
    problems = [f"{path.relative_to(ROOT)}: kvgraft.{area(name)} has no layer: add it to "
                f"LAYERS in tests/test_architecture.py and to the table in docs/architecture.md"
                for name, path in modules.items() if area(name) not in LAYERS]
    problems += [p for imp in found if (p := layer_problem(imp, modules))]
    if problems:
        pytest.fail("imports against the layer table (docs/architecture.md):\n"
                    + "\n".join(problems), pytrace=False)


def test_no_import_cycle() -> None:
    modules, found = all_imports()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for imp in found:
        if imp.imported in modules:
            edges[imp.importer].add(imp.imported)
    problems = []
    for component in cycles(edges):
        members = set(component)
        lines = [f"    {imp.where}: {imp.importer} imports {imp.imported}" for imp in found
                 if imp.importer in members and imp.imported in members]
        problems.append(f"import cycle between {', '.join(component)}:\n" + "\n".join(lines)
                        + "\n  move what these modules share into one module that imports "
                          "none of them (or pass it in from the caller), so the imports run "
                          "one way")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_cycle_finder_sees_a_cycle() -> None:
    # The check above passes on an acyclic tree; this shows it would not pass on a cyclic one.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_checks_see_lazy_imports_and_click() -> None:
    # Lazy imports are dependencies too; the checks above rely on the collector finding them.
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from kvgraft.client import Registry\n"
              "def f() -> None:\n    from kvgraft.server import app\n    import click\n")
    modules, _ = all_imports()
    found = imports_of("kvgraft.catalog.x", source, "x.py", modules)
    assert [(i.imported, i.where) for i in found] == [
        ("typing", "x.py:1"), ("kvgraft.client", "x.py:3"), ("kvgraft.server.app", "x.py:5"),
        ("click", "x.py:6")]
    problems = [layer_problem(imp, modules) for imp in found]
    assert problems[0] is None and all(problems[1:]), problems


def test_test_helpers_do_not_shadow_library_modules() -> None:
    library = {name.rpartition(".")[2] for name in library_files()}
    helpers = sorted((ROOT / "tests" / "support").glob("*.py"))
    clashes = [f"tests/support/{path.name} is named like a library module ({path.stem}): "
               f"rename it" for path in helpers
               if path.name != "__init__.py" and path.stem in library]
    if clashes:
        pytest.fail("\n".join(clashes), pytrace=False)
