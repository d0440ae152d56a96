"""The house rules, read from the source with `ast`: no import cycles, who may import whom, unit sizes.

- No import cycle at all, lazy (function-level) and TYPE_CHECKING imports included.
- common/ imports none of edge/, cloud/, sim/; edge/ and cloud/ never import each other (they meet
  in proto/); nothing outside sim/ imports sim/.
- common/ by concept: its top level is a fixed set of shared plumbing; common/lab/ (measurement) is
  imported only by sim/, edge/verifier_training/ and itself.
- No module over 400 lines, no function over 60 lines (tests excluded).
- Proto messages are built in the codec, the package common/wire/, alone: no call `pb.X(...)` (`pb` any name bound to
  sprinter.v1.decoding_pb2, X upper-case: a message) nor `X(...)` of a message imported from it, in
  common/, edge/, cloud/ or sim/ elsewhere (tests build frames by hand on purpose).
- A mode's traits live in one record (common/spec/modes.py's `Mode`): outside that module no
  comparison of a mode with a mode's name (`mode == "target"`, `r.mode in ("sd", "sd-block")`,
  `record["mode"] != "draft"`), and no module-level tuple, list or set of mode names (a copy of a
  trait, like `LOSSLESS = (...)`), but for RUN_PLANS: the modes a demo or bench runs, a choice and no trait.
  An expression is about a mode when it names one (a name, attribute or string key like mode,
  default_mode, modes); a mode name compared with anything else (a role, a dict key) is not one.
- One exception family: every exception class reaches `SprinterError` (common/errors.py), so a class
  naming a builtin exception base (`ValueError`, ...) names a `SprinterError` subclass too (bases are
  matched by name, common/errors.py itself excepted); no two exception classes share a name.
- tests/ mirrors the source tree: a test file sits in the folder of what it tests (tests/cloud/ for cloud/,
  tests/common/spec/ for common/spec/, ...), or in tests/house/ when it checks the whole house; the shared
  helpers and conftest.py stay at tests/'s top.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import Counter
from pathlib import Path

import pytest

from common.spec.modes import MODES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "edge", "cloud", "sim")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
PROTO_MODULE = "sprinter.v1.decoding_pb2"
WIRE_CODEC = "common.wire"
FORBIDDEN = {  # importer package -> packages it must never import
    "common": {"edge", "cloud", "sim"},
    "edge": {"cloud", "sim"},
    "cloud": {"edge", "sim"},
}

MODES_HOME = "common.spec.modes"
RUN_PLANS = {  # module-level tuples of mode names that are a choice of what to run, in order, not a trait
    "sim.demo.MODES": "the modes the demo asks in, one per kind of decoding",
    "sim.bench.local.OUR_MODES": "the modes bench-local times next to transformers' assisted generation",
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


# common/ by concept (docs/architecture.md): its top level is the plumbing every process shares; what a
# round does lives in common/spec/, what it computes with in common/model/ and common/sampling/.
COMMON_TOP = {"addresses", "admission", "arguments", "atomic_files", "cli", "errors", "otel_tracing", "prefix_digests",
              "stats", "table_cells", "tracing"}
LAB = "common.lab"  # measurement only
MEASUREMENT = ("sim", "common.lab", "edge.verifier_training")  # who may import it


def test_common_is_folders_by_concept_around_a_fixed_top() -> None:
    top = {name.split(".")[1] for name, path in MODULES.items()
           if name.startswith("common.") and name.count(".") == 1 and path.name != "__init__.py"}
    assert top == COMMON_TOP


def test_serving_code_never_imports_the_lab() -> None:
    serving = [f"{importer} imports {m}" for importer, imported in GRAPH.items()
               if not importer.startswith(MEASUREMENT) for m in sorted(imported) if m.startswith(LAB)]
    assert serving == []


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


def _proto_constructions(source: str, filename: str = "<source>") -> list[str]:
    """Calls that build a proto message: `alias.X(...)` of a module alias of PROTO_MODULE, or `X(...)` of a
    message imported from it by name (X upper-case), as "line: call"."""
    tree = ast.parse(source, filename)
    modules: set[str] = set()  # how the module is named in this file ("pb", "sprinter.v1.decoding_pb2")
    messages: set[str] = set()
    package, _, leaf = PROTO_MODULE.rpartition(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == PROTO_MODULE}
        elif isinstance(node, ast.ImportFrom) and node.module == package:
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == leaf}
        elif isinstance(node, ast.ImportFrom) and node.module == PROTO_MODULE:
            messages |= {alias.asname or alias.name for alias in node.names if alias.name[:1].isupper()}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr[:1].isupper() and ast.unparse(func.value) in modules
                or isinstance(func, ast.Name) and func.id in messages):
            found.append((node.lineno, node.col_offset, f"{node.lineno}: {ast.unparse(func)}(...)"))
    return [call for *_, call in sorted(found)]


def test_proto_messages_are_built_by_the_wire_codec_alone() -> None:
    built = {name: calls for name, path in MODULES.items()
             if name != WIRE_CODEC and not name.startswith(WIRE_CODEC + ".") and (calls := _proto_constructions(path.read_text(), str(path)))}
    assert built == {}


def test_the_proto_rule_catches_a_planted_construction() -> None:
    planted = """
from sprinter.v1 import decoding_pb2 as pb
import sprinter.v1.decoding_pb2
from sprinter.v1.decoding_pb2 import VerifyBlock as Block, METHOD_BLOCK

frame = pb.EdgeFrame(close=pb.CloseSession())
block = sprinter.v1.decoding_pb2.VerifyBlock(method=METHOD_BLOCK)
other = Block(start_position=pb.Method.Value("METHOD_TOKEN"))
fine = pb.DESCRIPTOR.services_by_name, wire.VerifyBlock(), METHOD_BLOCK
"""
    assert _proto_constructions(planted) == ["6: pb.EdgeFrame(...)", "6: pb.CloseSession(...)",
                                             "7: sprinter.v1.decoding_pb2.VerifyBlock(...)", "8: Block(...)"]
    assert _proto_constructions(MODULES[WIRE_CODEC].read_text())  # the codec itself is what builds them


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    """The rules above would catch what they claim to (a checker that finds nothing proves nothing)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert len(MODULES) > 30 and any(GRAPH.values())


_MODE_WORD = re.compile(r"(^|_)modes?($|_)")


def _is_mode_name(node: ast.AST) -> bool:
    """A string constant naming a mode (a sweep's `mode@policy` too)."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.partition("@")[0] in MODES


def _has_mode_name(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_mode_name(e) for e in node.elts)
    return _is_mode_name(node)


def _about_a_mode(node: ast.AST) -> bool:
    """The expression names a mode: `mode`, `args.default_mode`, `record["mode"]` (not `model`)."""
    for sub in ast.walk(node):
        word = (sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute)
                else sub.slice.value if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) else None)
        if isinstance(word, str) and _MODE_WORD.search(word.lower()):
            return True
    return False


def mode_name_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a mode with a mode's name, or testing it against a literal of them."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [s for s in sides if _has_mode_name(s)]
            if names and any(_about_a_mode(s) for s in sides if not any(s is n for n in names)):
                found.append(node.lineno)
    return found


def mode_name_tuples(tree: ast.Module) -> list[str]:
    """Module-level names bound to a tuple, list or set (frozenset(...) too) of two or more mode names."""
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and len(value.args) == 1:
            value = value.args[0]  # frozenset({...}), tuple([...])
        if (isinstance(value, (ast.Tuple, ast.List, ast.Set)) and len(value.elts) >= 2
                and all(_is_mode_name(e) for e in value.elts)):
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return found


def test_modes_are_asked_for_traits_never_compared_by_name() -> None:
    broken, plans = [], set()
    for name, path in MODULES.items():
        if name == MODES_HOME:
            continue
        tree = ast.parse(path.read_text(), str(path))
        broken += [f"{path.relative_to(ROOT)}:{line}: compares a mode with a mode's name"
                   for line in mode_name_comparisons(tree)]
        for constant in mode_name_tuples(tree):
            if f"{name}.{constant}" in RUN_PLANS:
                plans.add(f"{name}.{constant}")
            else:
                broken.append(f"{name}.{constant}: a module-level tuple of mode names")
    assert broken == []
    assert plans == set(RUN_PLANS)  # no allowance outlives the plan it allows


def test_the_mode_rule_catches_planted_comparisons_and_spares_the_rest() -> None:
    planted = ast.parse(
        'if mode == "target": pass\n'                        # 1
        'ok = r.mode in ("sd", "sd-block")\n'                 # 2
        'ok = record["mode"] != "draft"\n'                    # 3
        'ok = "sprinter" == self.profile.mode\n'              # 4
        'ok = base_mode(m) not in {"sprinter-exact@goodput"}\n'  # 5
        'LOSSLESS = ("target", "sd", "sd-block")\n'
        'STREAMED: frozenset = frozenset({"sprinter", "sprinter-exact"})\n'
        # spared: a mode name as a dict key or a role, a mode compared with a constant from modes.py,
        # a product name beside a model, tuples that mix mode names with other words
        'ok = "draft" in draft_step\n'
        'ok = role == "target" or pair["target"] == spec\n'
        'ok = mode == REFERENCE or mode in LOSSLESS_MODES\n'
        'ok = model_name == "sprinter"\n'
        'IDENTITY = ("target", "draft", "verifier")\n')
    assert mode_name_comparisons(planted) == [1, 2, 3, 4, 5]
    assert mode_name_tuples(planted) == ["LOSSLESS", "STREAMED"]


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


@pytest.mark.parametrize("program", ["generate", "cloud", "edge", "verifier", "simulate", "bench", "fleet", "link", "demo", "docs"])
def test_every_program_is_a_sprinter_subcommand(program: str) -> None:
    from common.cli import build_parser

    subcommands = next(a for a in build_parser()._actions if a.dest == "command")
    assert program in subcommands.choices


TESTS = ROOT / "tests"
WHOLE_HOUSE = "house"  # tests/house/: checks of the whole house (these rules, the docs, the CLI), no one folder's


def _misplaced_test(relative: Path, root: Path = ROOT) -> str | None:
    """Why a test file at `relative` (to tests/) breaks the mirror, or None where it keeps it."""
    folder = relative.parent
    if not folder.parts:
        return f"tests/{relative} sits at tests/'s top: move it into the folder of what it tests"
    if folder.parts[0] == "tests" or (folder.as_posix() != WHOLE_HOUSE and not (root / folder).is_dir()):
        return f"tests/{relative} is in tests/{folder.as_posix()}/, which mirrors no source folder"
    return None


def test_tests_mirror_the_source_tree() -> None:
    tests = sorted(path.relative_to(TESTS) for path in TESTS.rglob("test_*.py"))
    assert len(tests) > 50
    assert [why for why in map(_misplaced_test, tests) if why] == []


def test_the_mirror_rule_catches_planted_misplacements() -> None:
    assert _misplaced_test(Path("cloud/test_x.py")) is None
    assert _misplaced_test(Path("common/spec/tree/test_x.py")) is None
    assert _misplaced_test(Path("house/test_x.py")) is None
    assert [bool(_misplaced_test(Path(p))) for p in ("test_x.py", "clouds/test_x.py", "edge/api/v2/test_x.py",
                                                      "tests/cloud/test_x.py", "house/cloud/test_x.py")] == [True] * 5
