"""`sprinter edge serve`: the edge daemon (OpenAI-compatible HTTP API on localhost)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from common.decoding.modes import MODES
from common.models import DTYPES
from edge.generate_command import add_cloud_arguments, add_companion_argument, add_policy_argument

log = logging.getLogger(__name__)


def register(subcommands: argparse._SubParsersAction) -> None:
    edge = subcommands.add_parser("edge", help="the edge daemon").add_subparsers(dest="edge_command", required=True)
    p = edge.add_parser("serve", help="serve the OpenAI-compatible API backed by the draft and the cloud",
                        description="Run the draft (and verifier) here; verify on the cloud; serve /v1 on localhost.")
    p.add_argument("--draft", default="tiny-random-draft")
    p.add_argument("--verifier", default="auto", help="auto (the shipped verifier for this pair, else confidence:0.5), confidence:T or a verifier.json")
    add_companion_argument(p)
    p.add_argument("--mode", default="sprinter-exact", choices=MODES, help="default mode; a request may set its own")
    add_policy_argument(p, " (default for requests; a request may set its own)")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT")
    p.add_argument("--model-name", help="the model id the API reports (default: the draft's spec)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    add_cloud_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from edge.api.app import create_app
    from edge.node import EdgeNode, EdgeNodeSettings

    host, _, port = args.listen.rpartition(":")
    async with EdgeNode(EdgeNodeSettings.from_args(args)) as node:
        app = create_app(node, args.mode, args.model_name or args.draft, args.policy)
        server = uvicorn.Server(uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), log_level="warning",
                                               lifespan="off"))
        log.info("edge daemon on http://%s/v1 (mode %s, policy %s, cloud %s)", args.listen, args.mode,
                 args.policy or "the mode's default", args.cloud)
        await server.serve()
