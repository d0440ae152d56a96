r"""`sprinter link`: the link emulator alone, between any TCP client and its server.

    sprinter link --upstream 127.0.0.1:50051 --listen 127.0.0.1:7000 --delay-ms 25ms --jitter-ms 5ms \
        --bandwidth-mbps 20mbit --loss 1% --disconnect 30:5 --delay-change 60:100ms

Clients connect to --listen and reach --upstream through the emulated link (sim.link.proxy);
it runs until Ctrl-C, then logs what went through.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import NoReturn

from sim.link.proxy import LinkProxy
from sim.link.shaping import LinkSettings
from sim.link.units import (parse_address, parse_delay_change, parse_disconnect, parse_listen_address, parse_mbps,
                            parse_ms, parse_probability)

log = logging.getLogger(__name__)


def _argument(parse: Callable[[str], object]) -> Callable[[str], object]:
    """argparse reports ArgumentTypeError messages verbatim (ValueError becomes 'invalid value')."""
    def wrapped(text: str) -> object:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    wrapped.__name__ = parse.__name__
    return wrapped


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("link", help="the link emulator alone: a TCP proxy with delay, jitter, loss",
                               description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=_argument(parse_listen_address), default=("127.0.0.1", 7000), help="HOST:PORT")
    p.add_argument("--upstream", type=_argument(parse_address), required=True, help="HOST:PORT")
    p.add_argument("--delay-ms", type=_argument(parse_ms), default=0.0, help="one way, e.g. 25 or 25ms")
    p.add_argument("--jitter-ms", type=_argument(parse_ms), default=0.0)
    p.add_argument("--jitter-distribution", choices=("normal", "pareto"), default="normal")
    p.add_argument("--bandwidth-mbps", type=_argument(parse_mbps), default=None, help="per direction")
    p.add_argument("--loss", type=_argument(parse_probability), default=0.0, help="e.g. 0.01 or 1%%")
    p.add_argument("--disconnect", type=_argument(parse_disconnect), action="append", default=[],
                   metavar="AT:DURATION", help="seconds after start; repeatable")
    p.add_argument("--delay-change", type=_argument(parse_delay_change), action="append", default=[],
                   metavar="AT:DELAY", help="from AT seconds after start, the one-way delay is DELAY; repeatable")
    p.add_argument("--seed", type=int, default=0)
    # Settings that parse but do not make a link (a loss of 2) are usage errors too: exit 2 with usage.
    p.set_defaults(run=functools.partial(run, fail=p.error))


async def serve(settings: LinkSettings, upstream: tuple[str, int], listen: tuple[str, int]) -> None:
    """The proxy until cancelled (Ctrl-C), then its statistics in the log."""
    async with LinkProxy(settings, upstream, listen) as link:
        log.info("listening on %s; Ctrl-C stops", link.address)
        try:
            await asyncio.Event().wait()
        finally:
            log.info("%s", link.stats)


def run(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> int:
    try:
        settings = LinkSettings(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
                                jitter_distribution=args.jitter_distribution, bandwidth_mbps=args.bandwidth_mbps,
                                loss=args.loss, disconnects=tuple(args.disconnect), seed=args.seed,
                                delay_changes=tuple(args.delay_change))
    except ValueError as err:
        fail(str(err))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings, args.upstream, args.listen))
    return 0
