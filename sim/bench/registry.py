"""A bench's flags, generated from its settings dataclass: one flag per field, named as the field, typed as it.

    add_settings_arguments(parser, LlamaCppBenchSettings, helps={"edges": "sessions verifying at once"})
    settings = settings_from(args, LlamaCppBenchSettings)

So a bench's flags and its settings cannot drift apart (`--max-new-tokens` is `max_new_tokens`), and its
results.json records the same names its command line used.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import typing
from pathlib import Path
from typing import Any, TypeVar

from common.arguments import comma_list

S = TypeVar("S")


def described(module: str) -> dict[str, object]:
    """A bench's --help is its module's docstring, read from the source: importing the module would load torch."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return {"description": ast.get_docstring(ast.parse(source), clean=False),
            "formatter_class": argparse.RawDescriptionHelpFormatter}


def add_settings_arguments(parser: argparse.ArgumentParser, settings_type: type, helps: dict[str, str]) -> None:
    """`--field-name` for every field of `settings_type`, its default the dataclass's, its type the field's
    (a tuple of strings is a comma list)."""
    hints = typing.get_type_hints(settings_type)
    for item in dataclasses.fields(settings_type):
        kind, default = hints[item.name], item.default
        parse: Any = comma_list(str, "names") if typing.get_origin(kind) is tuple else kind
        shown = ",".join(default) if isinstance(default, tuple) else default
        parser.add_argument("--" + item.name.replace("_", "-"), type=parse, default=default,
                            help=f"{helps.get(item.name, '')} (default: {shown})".lstrip())


def settings_from(args: argparse.Namespace, settings_type: type[S]) -> S:
    return settings_type(**{item.name: getattr(args, item.name) for item in dataclasses.fields(settings_type)})
