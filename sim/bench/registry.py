"""A bench's command, generated from its settings dataclass: one flag per field, named as the field, typed as it.

    LLAMA_CPP = Bench("llama-cpp", "the llama.cpp engine against llama-bench and llama-server, one core",
                      LlamaCppBenchSettings, "sim.bench.llama_cpp:bench_llama_cpp",
                      helps={"edges": "sessions verifying at once"}, plots=("plot.png",))

`register(benches, LLAMA_CPP)` adds `sprinter bench llama-cpp` with `--target`, `--edges`, ... (their defaults the
dataclass's), its --help the bench module's docstring (read from the source: importing the module would load
torch). Running it builds the settings from the flags, imports the bench, calls it with them, prints the table it
returns and, with `--page`, publishes the table and the plots. So a bench's flags and its settings cannot drift
apart (`--max-new-tokens` is `max_new_tokens`), and results.json (sim/bench/run_folder.py) records the names its
command line used.

A bench that judges its run (soak, chaos) returns `Verdict(table, passed)` instead of the table: the command prints
and publishes the table all the same, and exits 1 when the run failed.

Field types become flag types: int, float, str, Path; `X | None` (default None: the flag is optional); bool
(`--x` / `--no-x`); `Literal["a", "b"]` (choices); tuples of int, float, str or a Literal (comma lists).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from common.arguments import comma_list, one_of
from common.errors import UsageError

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class Bench:
    name: str  # the subcommand: `sprinter bench NAME`
    help: str  # its line in `sprinter bench --help`
    settings: type  # its settings dataclass: the flags
    run: str  # "module:function", called with the settings; returns the table (str, or a Verdict) it did not print
    helps: dict[str, str] = dataclasses.field(default_factory=dict)  # a field's help, by field name
    plots: tuple[str, ...] = ()  # files under --out that --page publishes beside the table
    quiet_http: bool = False  # the bench talks HTTP per request: a log line each would bury its progress

    @property
    def module(self) -> str:
        return self.run.partition(":")[0]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a bench that judges its run returns instead of the bare table: the command exits 1 when it failed."""

    table: str
    passed: bool


def described(module: str) -> dict[str, object]:
    """A bench's --help is its module's docstring, read from the source: importing the module would load torch."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return {"description": ast.get_docstring(ast.parse(source), clean=False),
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def register(benches: argparse._SubParsersAction, bench: Bench) -> argparse.ArgumentParser:
    parser = benches.add_parser(bench.name, help=bench.help, **described(bench.module))
    add_settings_arguments(parser, bench.settings, bench.helps)
    parser.set_defaults(run=lambda args: run(bench, args))
    return parser


def run(bench: Bench, args: argparse.Namespace) -> int:
    from common.lab.results_page import publish_if_asked
    from sim.processes import quiet_http_clients

    module, _, function = bench.run.partition(":")
    if bench.quiet_http:
        quiet_http_clients()
    try:
        settings = settings_from(args, bench.settings)
        table = getattr(importlib.import_module(module), function)(settings)
    except UsageError as err:  # a setting refused by the settings themselves or by the bench reading them together
        print(f"sprinter bench {bench.name}: {err}", file=sys.stderr)
        return 2  # a usage error's exit status, as argparse's
    table, passed = (table.table, table.passed) if isinstance(table, Verdict) else (table, True)
    print(table)
    out = getattr(settings, "out", None)
    plots = tuple(out / name for name in bench.plots if out is not None and (out / name).exists())
    if out is not None:
        print(f"\nwrote {out}/")
    publish_if_asked(args, table, plots)
    return 0 if passed else 1


def _flag_type(kind: Any) -> tuple[Callable[[str], Any] | None, dict[str, Any]]:
    """argparse's `type` and extra keywords for a field of type `kind`."""
    origin, parts = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [part for part in parts if part is not type(None)]
        return _flag_type(inner)
    if origin is typing.Literal:
        return str, {"choices": parts}
    if origin is tuple:
        item = parts[0]
        if typing.get_origin(item) is typing.Literal:  # names among choices: a wrong one is argparse's usage error
            return comma_list(one_of(typing.get_args(item), "name"), "names", allow_empty=True), {}
        return comma_list(item if item in (int, float) else str, f"{item.__name__}s", allow_empty=True), {}
    if kind is bool:
        return None, {"action": argparse.BooleanOptionalAction}
    return kind, {}


def add_settings_arguments(parser: argparse.ArgumentParser, settings_type: type, helps: dict[str, str]) -> None:
    """`--field-name` for every field of `settings_type`, its default the dataclass's, its type the field's."""
    hints = typing.get_type_hints(settings_type)
    for item in dataclasses.fields(settings_type):
        if not item.init:
            continue
        default = item.default if item.default is not dataclasses.MISSING else item.default_factory()
        parse, extra = _flag_type(hints[item.name])
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        if parse is not None:
            extra["type"] = parse
        parser.add_argument("--" + item.name.replace("_", "-"), default=default,
                            help=f"{helps.get(item.name, '')} (default: {shown})".lstrip(), **extra)


def require_at_least(settings: object, minimum: int, names: tuple[str, ...]) -> None:
    """A settings dataclass's check: each named field >= `minimum`, else a UsageError naming its flag."""
    for name in names:
        if getattr(settings, name) < minimum:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(settings, name)}")


def settings_from(args: argparse.Namespace, settings_type: type[S]) -> S:
    return settings_type(**{item.name: getattr(args, item.name) for item in dataclasses.fields(settings_type)
                            if item.init})
