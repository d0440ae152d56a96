"""Network addresses as the programs' safety checks see them."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """True for a loopback address or name; any other host name may resolve to anything, so False."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
