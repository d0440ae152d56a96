"""`sprinter cloud serve`: the gRPC target service."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import fields
from pathlib import Path

from cloud.server import CloudSettings, run_until_signalled

DEFAULTS = CloudSettings()


def register(subcommands: argparse._SubParsersAction) -> None:
    cloud = subcommands.add_parser("cloud", help="the cloud target service").add_subparsers(dest="cloud_command", required=True)
    p = cloud.add_parser("serve", help="serve the target model over gRPC",
                         description="Host the target model; verify blocks that edges send.")
    p.add_argument("--target", default=DEFAULTS.target, help="preset, Hugging Face id or directory")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=["bfloat16", "float32"])
    p.add_argument("--host", default=DEFAULTS.host)
    p.add_argument("--port", type=int, default=DEFAULTS.port)
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain; with --tls-key serves TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--auth-tokens", type=Path, help="file of 'EDGE_ID TOKEN' lines; without it, no authentication")
    p.add_argument("--max-sessions", type=int, default=DEFAULTS.max_sessions)
    p.add_argument("--kv-budget-mb", type=int, default=DEFAULTS.kv_budget_mb)
    p.add_argument("--max-block", type=int, default=DEFAULTS.max_block, help="draft tokens per verify frame")
    p.add_argument("--max-context", type=int, default=DEFAULTS.max_context)
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULTS.idle_timeout_s)
    p.add_argument("--batch-window-ms", type=float, default=DEFAULTS.batch_window_ms)
    p.add_argument("--max-batch", type=int, default=DEFAULTS.max_batch, help="1 turns batching off")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--drain-s", type=float, default=DEFAULTS.drain_s, help="SIGTERM: wait this long for open streams")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = CloudSettings(**{f.name: getattr(args, f.name) for f in fields(CloudSettings)})
    asyncio.run(run_until_signalled(settings))
    return 0
