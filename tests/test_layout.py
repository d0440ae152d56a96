"""The house rules, read from the source with `ast`: no import cycles, who may import whom, unit sizes.

- No import cycle at all, lazy (function-level) and TYPE_CHECKING imports included.
- common/ imports none of edge/, cloud/, sim/; edge/ and cloud/ never import each other (they meet
  in proto/); nothing outside sim/ imports sim/.
- No module over 400 lines, no function over 60 lines (tests excluded).
- One exception family: every exception class reaches `SprinterError` (common/errors.py), so a class
  naming a builtin exception base (`ValueError`, ...) names a `SprinterError` subclass too (bases are
  matched by name, common/errors.py itself excepted); no two exception classes share a name.
"""

from __future__ import annotations

import ast
import builtins
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "edge", "cloud", "sim")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
FORBIDDEN = {  # importer package -> packages it must never import
    "common": {"edge", "cloud", "sim"},
    "edge": {"cloud", "sim"},
    "cloud": {"edge", "sim"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules `name` imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            # the longest project module that the imported name lies in
            parts = candidate.split(".")
            for end in range(len(parts), 0, -1):
                prefix = ".".join(parts[:end])
                if prefix in MODULES:
                    if prefix != name:
                        found.add(prefix)
                    break
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_import_graph_has_no_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_packages_import_only_what_the_house_rules_allow() -> None:
    broken = []
    for importer, imported in GRAPH.items():
        forbidden = FORBIDDEN.get(importer.split(".")[0], set())
        broken += [f"{importer} imports {m}" for m in sorted(imported) if m.split(".")[0] in forbidden]
    assert broken == []


def test_modules_stay_short() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_functions_stay_short() -> None:
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert long == []


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    """The rules above would catch what they claim to (a checker that finds nothing proves nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert len(MODULES) > 30 and any(GRAPH.values())


ROOT_EXCEPTION = "SprinterError"
ROOT_MODULE = "common.errors"
BUILTIN_EXCEPTIONS = frozenset(name for name, value in vars(builtins).items()
                               if isinstance(value, type) and issubclass(value, BaseException))


def _classes(sources: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """(module, class, the names of its bases) for every class, nested ones included; `a.B` is named `B`."""
    found = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                found.append((module, node.name, bases))
    return found


def _closure(classes: list[tuple[str, str, list[str]]], seeds: set[str]) -> set[str]:
    """The seeds and every class that derives from one of them, by name."""
    reached = set(seeds)
    while grown := {name for _, name, bases in classes if name not in reached and reached.intersection(bases)}:
        reached |= grown
    return reached


def _exception_classes(classes: list[tuple[str, str, list[str]]]) -> set[str]:
    """Classes deriving from a builtin exception, a third-party one (by its name), or one of these."""
    foreign = {b for _, _, bases in classes for b in bases if b.endswith(("Error", "Exception"))}
    return _closure(classes, set(BUILTIN_EXCEPTIONS) | foreign) - BUILTIN_EXCEPTIONS


def _family_violations(sources: dict[str, str]) -> list[str]:
    """Exception classes outside the family: a class naming only builtin (or third-party) exception bases,
    or deriving from one that does. A `SprinterError` subclass among the bases is what brings a class in."""
    classes = _classes(sources)
    family = _closure(classes, {ROOT_EXCEPTION})
    exceptions = _exception_classes(classes)
    broken = []
    for module, name, bases in classes:
        if name not in exceptions or module == ROOT_MODULE:
            continue
        if name not in family:  # e.g. `class X(ValueError)`: it must be `class X(SprinterError, ValueError)`
            broken.append(f"{module}.{name} does not reach {ROOT_EXCEPTION}")
    return broken


def _shared_exception_names(sources: dict[str, str]) -> list[str]:
    classes = _classes(sources)
    exceptions = _exception_classes(classes)
    counts = Counter(name for _, name, _ in classes if name in exceptions)
    return sorted(name for name, n in counts.items() if n > 1)


SOURCES = {name: path.read_text() for name, path in MODULES.items()}


def test_every_exception_reaches_the_root() -> None:
    assert _family_violations(SOURCES) == []


def test_no_two_exception_classes_share_a_name() -> None:
    assert _shared_exception_names(SOURCES) == []


def test_the_exception_rules_catch_planted_violations() -> None:
    planted = {
        ROOT_MODULE: "class SprinterError(Exception): ...\nclass PairMismatch(SprinterError, ValueError): ...",
        "a": "class Loose(ValueError): ...\nclass Child(Loose): ...\nclass Kept(SprinterError, KeyError): ...\n"
             "class Linked(grpc.RpcError): ...\nclass Mixed(Kept, RuntimeError): ...\nclass Plain: ...",
        "b": "class Bare(RuntimeError, PairMismatch): ...\nclass Loose(Exception): ...",
        "c": "def f():\n    class Inner(asyncio.TimeoutError): ...",
    }
    assert _family_violations(planted) == [
        "a.Loose does not reach SprinterError", "a.Child does not reach SprinterError",
        "a.Linked does not reach SprinterError", "b.Loose does not reach SprinterError",
        "c.Inner does not reach SprinterError"]
    assert _shared_exception_names(planted) == ["Loose"]
    assert _family_violations({ROOT_MODULE: planted[ROOT_MODULE], "d": "class Odd(OSError, Kept): ...\n"
                               "class Kept(SprinterError): ..."}) == []
    assert len(_exception_classes(_classes(SOURCES))) > 10


@pytest.mark.parametrize("program", ["generate", "cloud", "edge", "verifier", "simulate", "bench", "fleet", "link", "demo"])
def test_every_program_is_a_sprinter_subcommand(program: str) -> None:
    from common.cli import build_parser

    subcommands = next(a for a in build_parser()._actions if a.dest == "command")
    assert program in subcommands.choices
