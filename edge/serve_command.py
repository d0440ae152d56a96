"""`sprinter edge serve`: the edge daemon (OpenAI-compatible HTTP API on localhost)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from contextlib import AbstractAsyncContextManager, nullcontext
from importlib.metadata import PackageNotFoundError, version
from typing import Iterator

from common.addresses import is_loopback
from common.arguments import DTYPE_NAMES, host_port
from common.spec.modes import AUTO_MODE, MODE_CHOICES
from common.fleet_plane.command import add_broker_arguments, broker_settings
from common.fleet_plane.topics import check_identifier
from common.tracing import add_tracing_argument, enable_from_flag, tracer
from edge.generate_command import (add_branch_argument, add_cloud_arguments, add_companion_argument, add_policy_argument,
                                   add_proposer_arguments)

log = logging.getLogger(__name__)


# --draft-cache-mb's default (edge/runtime/draft_reuse.py; the parser imports no numpy): 256 MB holds about 10k
# tokens of Qwen2.5-0.5B's float32 KV (24 KB a token, the ONNX runtime's) or 5k of SmolLM2-135M's (46 KB): a few
# conversations of a few thousand tokens, next to a draft that itself takes 0.5-2 GB. A gateway may give it more.
DEFAULT_DRAFT_CACHE_MB = 256

def register(subcommands: argparse._SubParsersAction) -> None:
    edge = subcommands.add_parser("edge", help="the edge daemon").add_subparsers(dest="edge_command", required=True)
    p = edge.add_parser("serve", help="serve the OpenAI-compatible API backed by the draft and the cloud",
                        description="Run the draft (and verifier) here; verify on the cloud; serve /v1 on localhost.")
    p.add_argument("--draft", default="tiny-random-draft")
    p.add_argument("--verifier", default="auto", help="auto (the shipped verifier for this pair, else confidence:0.5), confidence:T, "
                                                       "margin-logistic[:T] (fitted online) or a verifier.json")
    add_companion_argument(p)
    p.add_argument("--mode", choices=MODE_CHOICES,
                   help="default mode; a request may set its own (default: auto with --cloud, else sprinter-exact). "
                        "auto: per request, the target alone, speculating here or in the cloud, whichever the cost "
                        "model predicts fastest (needs --cloud)")
    add_policy_argument(p, " (default for requests; a request may set its own)")
    add_proposer_arguments(p, " (default for requests; a request may set its own: proposer)")
    add_branch_argument(p, " (default for requests in modes that take trees; a request may set its own: branch_tokens)")
    p.add_argument("--listen", type=host_port, default="127.0.0.1:8000", metavar="HOST:PORT")
    p.add_argument("--model-name", help="the model id the API reports (default: the draft's spec)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    add_cloud_arguments(p)
    add_api_arguments(p)
    add_fleet_arguments(p)
    p.set_defaults(run=run)


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    add_broker_arguments(p)
    p.add_argument("--edge-id", help="this edge's name on the fleet plane (default: edge-PORT of --listen)")
    p.add_argument("--group", default="default", help="the fleet group whose config this edge follows")
    p.add_argument("--telemetry-interval", type=float, default=5.0, metavar="S", help="seconds between telemetry")


def add_api_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (or env SPRINTER_API_KEY)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --listen address without --api-key (anyone who reaches it may use it)")
    p.add_argument("--max-concurrent-requests", type=int, default=64, metavar="N",
                   help="generations in flight; more get 429 with Retry-After (0: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=2 << 20, metavar="BYTES", help="larger bodies get 413")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="cap on prompt + completion tokens (default: the draft's window and the cloud's max_context)")
    p.add_argument("--cloud-retry-s", type=float, default=2.0,
                   help="while the cloud is out of reach, how often a generation tries it again")
    p.add_argument("--draft-cache-mb", type=_non_negative_mb, default=DEFAULT_DRAFT_CACHE_MB, metavar="MB",
                   help="memory for the draft's prompt KV kept across requests, so a conversation's next turn and "
                        "a request's n choices prefill only what is new on the edge (least recently used out first; "
                        f"0: off). Default {DEFAULT_DRAFT_CACHE_MB}")
    add_tracing_argument(p)


def _non_negative_mb(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected megabytes >= 0 (0: off), got {text}")
    return value


def listen_problem(listen: str, api_key: str | None, allow_unauthenticated: bool) -> str | None:
    host, _, port = listen.rpartition(":")
    if not port.isdigit() or not host:
        return f"--listen {listen!r}: expected HOST:PORT"
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        return (f"--listen {listen} is reachable from other machines, and there is no --api-key: anyone could use "
                "this edge and its cloud. Give --api-key KEY, or --allow-unauthenticated if that is intended")
    return None


def default_mode(cloud: object) -> str:
    """The daemon's mode when --mode is not given: with a cloud, `auto`, which streams the target alone where
    speculating would not pay (docs/benchmarks/auto.md: within 0.97x of the best fixed mode on both cloud engines);
    without one, sprinter-exact, which drafts here and verifies once a cloud is found (--mqtt)."""
    return AUTO_MODE if cloud else "sprinter-exact"


def fleet_problem(args: argparse.Namespace) -> str | None:
    if not args.mqtt:
        return None
    args.edge_id = args.edge_id or f"edge-{args.listen.rpartition(':')[2]}"
    try:
        broker_settings(args)
        check_identifier(args.edge_id, "--edge-id")
        check_identifier(args.group, "--group")
    except ValueError as err:
        return str(err)
    return None if args.telemetry_interval > 0 else "--telemetry-interval must be > 0"


def run(args: argparse.Namespace) -> int:
    from edge.node import EdgeNodeSettings

    args.api_key = args.api_key or os.environ.get("SPRINTER_API_KEY")
    args.mode = args.mode or default_mode(args.cloud)
    problem = listen_problem(args.listen, args.api_key, args.allow_unauthenticated) or fleet_problem(args)
    try:
        node_settings = EdgeNodeSettings.from_args(args)
    except ValueError as err:
        problem = problem or str(err)
    if not problem and args.mode == AUTO_MODE and not args.cloud and not getattr(args, "mqtt", None):
        problem = "--mode auto chooses among ways of using a cloud (--cloud, or --mqtt to find one)"
    if not problem and args.placement != "edge" and not args.cloud and not getattr(args, "mqtt", None):
        problem = f"--placement {args.placement} needs a cloud to draft in (--cloud, or --mqtt to find one)"
    if problem:
        print(f"sprinter edge serve: {problem}", file=sys.stderr)
        return 2
    enable_from_flag(args.otlp_traces_endpoint, "sprinter-edge", args.edge_id or f"edge-{args.listen}")
    try:
        asyncio.run(serve(args, node_settings))
    finally:
        tracer.shutdown()  # the spans still buffered go out before the process ends
    return 0


async def serve(args: argparse.Namespace, node_settings: object) -> None:
    import uvicorn

    from edge.api.app import ApiSettings, create_app
    from edge.node import EdgeNode

    host, _, port = args.listen.rpartition(":")
    api = ApiSettings(default_mode=args.mode, model_name=args.model_name or args.draft, default_policy=args.policy,
                      default_pipeline=args.pipeline, default_placement=args.placement, default_proposer=args.proposer,
                      default_branch_tokens=args.branch_tokens,
                      api_key=args.api_key, max_concurrent_requests=args.max_concurrent_requests,
                      max_request_bytes=args.max_request_bytes, cloud_retry_s=args.cloud_retry_s,
                      request_deadline_s=args.request_deadline_s, pipeline_adapts=args.pipeline_adapts,
                      draft_dists=args.draft_dists)
    StoppingServer = _stopping_server_class()
    async with EdgeNode(node_settings) as node:
        app = create_app(node, api)
        server = StoppingServer(uvicorn.Config(app, host=host.strip("[]"), port=int(port), log_level="warning",
                                               lifespan="off"))
        log.info("edge daemon on http://%s/v1 (mode %s, policy %s, cloud %s%s)", args.listen, args.mode,
                 args.policy or "the mode's default", args.cloud, ", API key required" if args.api_key else "")
        async with fleet_presence(args, node, app.state.completions):
            await server.serve()


def _stopping_server_class() -> type:
    import uvicorn

    class StoppingServer(uvicorn.Server):
        """Stops on SIGINT/SIGTERM by returning from serve(). uvicorn's own handling raises the signal again
        once it has stopped (a KeyboardInterrupt), which would cut the fleet agent's goodbye short."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return StoppingServer


def fleet_presence(args: argparse.Namespace, node: object, service: object) -> AbstractAsyncContextManager:
    """This edge on the fleet plane (presence, telemetry, config, verifiers), with --mqtt; nothing without it."""
    if not args.mqtt:
        return nullcontext()
    from edge.fleet_agent import EdgeIdentity, FleetAgent
    from edge.fleet_controls import DaemonControls

    identity = EdgeIdentity(args.edge_id, args.group, software_version(), f"http://{args.listen}/v1")
    return FleetAgent(broker_settings(args), identity, DaemonControls(node, service, identity),
                      telemetry_interval_s=args.telemetry_interval)


def software_version() -> str:
    try:
        return version("sprinter")
    except PackageNotFoundError:
        return "unknown"
