"""Kernel mode of the link emulator: two network namespaces joined by a veth pair shaped by netem.

Real packets, real TCP (real retransmissions on loss), at the cost of needing root, `ip`, `tc` and
the kernel's sch_netem. `sim.link.proxy.LinkProxy` is the portable mode; this one cross-checks it.

    with netem_link(LinkSettings(delay_ms=25, jitter_ms=5)) as link:
        server = link.popen("b", sys.executable, "-m", "common.cli", "cloud", "serve", ...)
        link.run("a", sys.executable, "-m", "common.cli", "generate", "--cloud", f"{link.addresses[1]}:50051", ...)

Differences from the proxy: netem drops packets (`loss` is per packet) and TCP recovers, netem's
jitter is its own (normal and pareto tables, symmetric around delay_ms), draws are not seeded, and
`disconnects` are not emulated.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Literal

from sim.link.shaping import LinkSettings

Side = Literal["a", "b"]
SUBNET = "10.213.0"  # a /30 that is unlikely to collide with the host's networks


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netem_available() -> tuple[bool, str]:
    """(True, "") when kernel mode can run here, else (False, why not)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found (apt-get install iproute2)"
    # The only reliable test is to try: a netem qdisc on the loopback of a throwaway namespace.
    probe = f"sprinter-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as err:
        return False, f"cannot create a network namespace: {err.stderr.strip()}"
    try:
        result = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                                 "netem", "delay", "1ms"], capture_output=True, text=True)
        if result.returncode != 0:
            return False, f"the kernel has no netem qdisc (sch_netem): tc says {result.stderr.strip()!r}"
        return True, ""
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def netem_arguments(settings: LinkSettings) -> list[str]:
    """`tc qdisc ... netem` arguments for one direction of the link."""
    args = ["delay", f"{settings.delay_ms}ms"]
    if settings.jitter_ms:
        args += [f"{settings.jitter_ms}ms", "distribution", settings.jitter_distribution]
    if settings.loss:
        args += ["loss", f"{settings.loss * 100}%"]
    if settings.bandwidth_mbps is not None:
        args += ["rate", f"{settings.bandwidth_mbps}mbit"]
    return args


@dataclass(frozen=True)
class NetnsLink:
    namespaces: tuple[str, str]
    addresses: tuple[str, str]  # of sides "a" and "b"

    def command(self, side: Side, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[side == "b"], *command]

    def run(self, side: Side, *command: str, **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(side, *command), **kwargs)

    def popen(self, side: Side, *command: str, **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(self.command(side, *command), **kwargs)


@contextmanager
def netem_link(settings: LinkSettings, name: str | None = None) -> Iterator[NetnsLink]:
    """Namespaces "<name>-a" and "<name>-b" joined by a veth pair, netem on both ends; removed on exit."""
    if settings.disconnects:
        raise ValueError("kernel mode does not emulate disconnects; use sim.link.proxy.LinkProxy")
    ok, reason = netem_available()
    if not ok:
        raise RuntimeError(f"kernel mode is not available: {reason}")
    name = name or f"sprinter-{os.getpid()}"
    namespaces = (f"{name}-a", f"{name}-b")
    addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
    created: list[str] = []
    try:
        for namespace in namespaces:
            _ip("netns", "add", namespace)
            created.append(namespace)
        # veth names are at most 15 characters and only need to be unique inside each namespace.
        _ip("link", "add", "veth-a", "netns", namespaces[0], "type", "veth", "peer", "name", "veth-b",
            "netns", namespaces[1])
        for namespace, device, address in zip(namespaces, ("veth-a", "veth-b"), addresses):
            _ip("-n", namespace, "address", "add", f"{address}/30", "dev", device)
            _ip("-n", namespace, "link", "set", device, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # Each end shapes what it sends, so both directions get the delay: the RTT is 2 * delay_ms.
            subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
                            "netem", *netem_arguments(settings)], check=True, capture_output=True, text=True)
        yield NetnsLink(namespaces, addresses)
    finally:
        for namespace in created:  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
