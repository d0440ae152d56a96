"""The link's quantities as people write them: "25ms", "0.05s", "20mbit", "1%", "30s:500ms", "host:port"."""

from __future__ import annotations

import re
from collections.abc import Callable

from common.arguments import port, port_or_zero

_TIME_MS = {"": 1.0, "ms": 1.0, "s": 1000.0, "us": 0.001}
_TIME_S = {"": 1.0, "s": 1.0, "ms": 0.001}
_RATE_MBPS = {"": 1.0, "mbit": 1.0, "mbps": 1.0, "kbit": 0.001, "kbps": 0.001, "gbit": 1000.0, "gbps": 1000.0}


def _quantity(text: str, units: dict[str, float], what: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in units:
        raise ValueError(f"cannot read {text!r} as {what} (e.g. {', '.join(repr('5' + u) for u in units if u)})")
    return float(match.group(1)) * units[match.group(2)]


def parse_ms(text: str) -> float:
    """"50ms", "0.05s" or a plain number of milliseconds."""
    return _quantity(text, _TIME_MS, "a duration")


def parse_mbps(text: str) -> float | None:
    """"20mbit", "500kbit", a plain number of Mbit/s, or "none" (unlimited)."""
    return None if text.strip().lower() in ("none", "unlimited", "inf") else _quantity(text, _RATE_MBPS, "a rate")


def parse_probability(text: str) -> float:
    """"1%" or "0.01"."""
    text = text.strip()
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def parse_disconnect(text: str) -> tuple[float, float]:
    """"AT:DURATION" in seconds, units allowed: "30:5", "30s:500ms"."""
    at, sep, duration = text.partition(":")
    if not sep:
        raise ValueError(f"a disconnect is AT:DURATION (seconds), got {text!r}")
    return _quantity(at, _TIME_S, "a time"), _quantity(duration, _TIME_S, "a duration")


def parse_delay_change(text: str) -> tuple[float, float]:
    """"AT:DELAY", seconds after start and the one-way delay from then on: "30:100ms", "1m:0.2s" is refused
    (seconds at most), "30:100" (milliseconds)."""
    at, sep, delay = text.partition(":")
    if not sep:
        raise ValueError(f"a delay change is AT:DELAY (seconds, then the new one-way delay), got {text!r}")
    return _quantity(at, _TIME_S, "a time"), _quantity(delay, _TIME_MS, "a delay")


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" or "[v6]:port" (no host: 127.0.0.1); a port out of 1-65535 is an argparse.ArgumentTypeError."""
    return _address(text, port)


def parse_listen_address(text: str) -> tuple[str, int]:
    """As `parse_address`, but port 0 is any free one (the proxy logs the port it got)."""
    return _address(text, port_or_zero)


def _address(text: str, read_port: Callable[[str], int]) -> tuple[str, int]:
    host, sep, number = text.rpartition(":")
    if not sep or not number.isdigit():
        raise ValueError(f"an address is HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", read_port(number)
