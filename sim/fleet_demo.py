"""`sprinter fleet demo` (`make demo-fleet`): a local fleet loses a cloud replica mid-run, and nobody notices.

    sprinter fleet demo --clouds 2 --edges 3 --requests 12

Starts a local fleet (`sprinter fleet up`'s: a broker when Mosquitto is installed, the replicas, the
edges), sends REQUESTS greedy completions at once through every edge in the lossless modes, SIGKILLs
replica cloud-0 as soon as sessions run on it, and prints what happened: each request's outcome
(complete? degraded? the same tokens as the same request sent after the fault?), how many sessions
moved and why, and, with the broker, the fleet's status after the fault (cloud-0 offline by its Last Will).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path

import httpx

from common.spec.modes import MODE_RECORDS
from common.fleet_plane.connection import BrokerSettings
from common.fleet_plane.operator import format_status, read_fleet
from sim.broker import mosquitto_binary
from sim.local_fleet import LocalFleet, add_fleet_arguments, settings_from_args
from sim.processes import quiet_http_clients

log = logging.getLogger(__name__)

MODES = tuple(m.name for m in MODE_RECORDS.values() if m.placeable)  # sd, sd-block, sprinter-exact: edges draft
PROMPTS = ("def fibonacci(n):", "The capital of France is", "Once upon a time", "import numpy as np")


def _body(i: int, max_tokens: int) -> dict:
    return {"model": "x", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "mode": MODES[i % len(MODES)]}


async def _requests(fleet: LocalFleet, n: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> dict:
            edge = fleet.edges[i % len(fleet.edges)]
            started = time.monotonic()
            response = await client.post(edge.base + "/v1/completions", json=_body(i, max_tokens))
            body = response.json()
            extension = body.get("sprinter", {})
            return {"request": i, "edge": i % len(fleet.edges), "mode": MODES[i % len(MODES)],
                    "status": response.status_code, "tokens": len(extension.get("token_ids", [])),
                    "token_ids": extension.get("token_ids"), "degraded": extension.get("degraded"),
                    "seconds": round(time.monotonic() - started, 2)}
        return await asyncio.gather(*(one(i) for i in range(n)))


def sessions_on(edge_bases: list[str], address: str) -> int:
    """The edges' sessions on one replica now, as their /healthz lists them."""
    total = 0
    for base in edge_bases:
        for replica in httpx.get(base + "/healthz", timeout=10).json().get("cloud_replicas") or []:
            total += replica["sessions"] if replica["address"] == address else 0
    return total


async def _kill_when_busy(fleet: LocalFleet) -> float | None:
    victim = fleet.clouds[0]
    for _ in range(3000):
        if await asyncio.to_thread(sessions_on, [e.base for e in fleet.edges], victim.address) >= 2:
            await asyncio.to_thread(victim.kill)
            return time.monotonic()
        await asyncio.sleep(0.01)
    return None


async def scenario(fleet: LocalFleet, n: int, max_tokens: int) -> dict:
    started = time.monotonic()
    killer = asyncio.create_task(_kill_when_busy(fleet))
    during = await _requests(fleet, n, max_tokens)
    killed_at = await killer
    after = await _requests(fleet, n, max_tokens)  # the same requests on the surviving replica: the reference
    reopens: Counter[str] = Counter()
    for edge in fleet.edges:
        reopens.update(httpx.get(edge.base + "/healthz", timeout=10).json().get("cloud_reopens") or {})
    for d, a in zip(during, after):
        d["same_as_after"] = d["token_ids"] == a["token_ids"]
    return {"killed_after_s": None if killed_at is None else round(killed_at - started, 2), "requests": during,
            "reopens": dict(reopens)}


def report(result: dict) -> str:
    rows = result["requests"]
    lines = ["| request | edge | mode | HTTP | tokens | degraded | same tokens as after the fault | s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['request']} | edge-{r['edge']} | {r['mode']} | {r['status']} | {r['tokens']} | {r['degraded']} "
              f"| {r['same_as_after']} | {r['seconds']} |" for r in rows]
    complete = sum(r["status"] == 200 for r in rows)
    killed = result["killed_after_s"]
    lines += ["", f"cloud-0 SIGKILLed {killed} s into the run" if killed is not None else "cloud-0 was never busy",
              f"{complete} of {len(rows)} requests complete, {sum(bool(r['degraded']) for r in rows)} degraded, "
              f"{sum(r['same_as_after'] for r in rows)} with the same tokens as after the fault",
              f"sessions reopened elsewhere, by cause: {result['reopens'] or 'none'}"]
    return "\n".join(lines)


def register(programs: argparse._SubParsersAction) -> None:
    """Adds `demo` to `sprinter fleet` (entry-point group sprinter.fleet_commands)."""
    p = programs.add_parser("demo", help="a local fleet loses a cloud replica mid-run (make demo-fleet)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fleet_arguments(p, clouds=2, edges=3)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("results/fleet-demo"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    quiet_http_clients()
    if args.clouds < 2:
        raise SystemExit("sprinter fleet demo: --clouds must be >= 2 (one of them is killed)")
    try:
        mosquitto_binary()
        mqtt = True
    except FileNotFoundError:
        log.warning("Mosquitto is not installed: the demo runs without the fleet plane")
        mqtt = False
    with LocalFleet(settings_from_args(args, mqtt, args.out)) as fleet:
        print(fleet.describe() + "\n", flush=True)
        result = asyncio.run(scenario(fleet, args.requests, args.max_tokens))
        print(report(result))
        if fleet.broker is not None:
            print("\n" + format_status(asyncio.run(read_fleet(BrokerSettings.parse(fleet.broker.url), wait_s=2.5))))
    (args.out / "demo.json").write_text(json.dumps(result, indent=1))
    rows = result["requests"]
    return 0 if all(r["status"] == 200 and not r["degraded"] for r in rows) else 1
