"""Network addresses as the programs' safety checks see them."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def split_host_port(address: str) -> tuple[str, str]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError naming the address otherwise."""
    host, _, port = address.strip().rpartition(":")
    if not host.strip("[]") or not port.isdigit():
        raise ValueError(f"address {address!r}: expected HOST:PORT")
    return host.strip("[]"), port


def is_loopback(host: str) -> bool:
    """True for a loopback address or name; any other host name may resolve to anything, so False."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def join_host_port(host: str, port: int | str) -> str:
    """HOST:PORT, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
