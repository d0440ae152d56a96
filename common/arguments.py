"""argparse types every command shares, so that a wrong value is a usage error naming its flag.

argparse reports a `type=` function's `ArgumentTypeError` (or `ValueError`) as
"argument --flag: ..." with exit code 2; a value checked later, in a command's `run`, would surface as
an exception far from the flag. This module imports nothing heavy: `sprinter --help` loads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from common.addresses import split_host_port

T = TypeVar("T")

# The dtypes every command accepts for torch models (ONNX Runtime runs the draft in float32);
# common/model/loading.py maps them to torch's.
DTYPE_NAMES = ("bfloat16", "float32")

MAX_PORT = 65535


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    return _port_in(text, 1)


def port_or_zero(text: str) -> int:
    """A TCP port, or 0 for any free one."""
    return _port_in(text, 0)


def _port_in(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not lowest <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"port {value} is out of range ({lowest}-{MAX_PORT})")
    return value


def host_port(text: str) -> str:
    """'HOST:PORT' (or '[v6]:PORT') with a port in 1-65535; the text itself, as the commands pass it on."""
    try:
        _, number = split_host_port(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    port(number)
    return text


def host_port_list(text: str) -> str:
    """A comma-separated list of HOST:PORT addresses (cloud replicas); the text itself."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    for entry in entries:
        host_port(entry)
    return text


def comma_list(item: Callable[[str], T], what: str, allow_empty: bool = False) -> Callable[[str], tuple[T, ...]]:
    """A type for 'A,B,C': each item read by `item`; `what` names an item in the error; '' is () if `allow_empty`."""
    def parse(text: str) -> tuple[T, ...]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts and not (allow_empty and not text.strip()):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        try:
            return tuple(item(part) for part in parts)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r} ({err})") from None

    parse.__name__ = f"list of {what}"
    return parse


def one_of(choices: tuple[str, ...] | list[str], what: str) -> Callable[[str], str]:
    """An item type for `comma_list`: a name among `choices`."""
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"unknown {what} {text!r}; choose from {', '.join(choices)}")
        return text

    return parse


floats = comma_list(float, "numbers")
ints = comma_list(int, "integers")
names = comma_list(str, "names")
