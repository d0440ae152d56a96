"""`sprinter fleet`: the fleet's operator commands, and the fleet programs other packages register.

    sprinter fleet status --mqtt mqtt://broker:1883 [--watch 2]
    sprinter fleet apply --mqtt URL --group G config.json      # waits for every online edge's answer
    sprinter fleet push-verifier --mqtt URL --group G DIR      # DIR holds verifier.json + its ONNX

Other packages add `sprinter fleet ...` programs through the `sprinter.fleet_commands` entry-point
group (`sprinter fleet up` and `demo`: a local fleet as processes; `sprinter fleet simulate`: the
fleet-scale simulator), so this module imports no side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any
from importlib.metadata import entry_points
from pathlib import Path

from common.fleet_plane.connection import BrokerSettings
from common.fleet_plane.messages import VerifierArtifact
from common.fleet_plane.operator import apply_config, format_status, push_verifier, read_fleet


def broker_url(text: str) -> str:
    """argparse type of --mqtt: a URL BrokerSettings can read (the text itself; TLS files join it later)."""
    try:
        BrokerSettings.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_broker_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--mqtt and the broker's TLS and credentials: shared by the edge, the cloud and these commands."""
    p.add_argument("--mqtt", type=broker_url, required=required, metavar="URL",
                   help="fleet plane broker: mqtt://[USER:PASSWORD@]HOST[:PORT] or mqtts://... (TLS)")
    p.add_argument("--mqtt-ca", type=Path, help="PEM roots the broker's certificate is checked against")
    p.add_argument("--mqtt-cert", type=Path, help="client certificate (PEM), with --mqtt-key")
    p.add_argument("--mqtt-key", type=Path)
    p.add_argument("--mqtt-keepalive", type=int, default=10, metavar="S",
                   help="MQTT keepalive; a dead peer's Last Will fires within 1.5x this")


def broker_settings(args: argparse.Namespace) -> BrokerSettings:
    return BrokerSettings.parse(args.mqtt, ca_file=args.mqtt_ca, cert_file=args.mqtt_cert, key_file=args.mqtt_key,
                                keepalive_s=args.mqtt_keepalive)


def register(subcommands: argparse._SubParsersAction) -> None:
    fleet = subcommands.add_parser("fleet", help="the fleet: status, config and verifier rollout; simulation",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    programs = fleet.add_subparsers(dest="fleet_command", required=True, metavar="PROGRAM")
    status = programs.add_parser("status", help="edges and cloud replicas, from retained state and telemetry")
    add_broker_arguments(status, required=True)
    status.add_argument("--watch", type=float, metavar="S", help="refresh every S seconds until Ctrl-C")
    status.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    status.set_defaults(run=run_status)
    apply = programs.add_parser("apply", help="publish a group's desired config and wait for every edge's answer")
    add_broker_arguments(apply, required=True)
    apply.add_argument("--group", required=True)
    apply.add_argument("--timeout", type=float, default=10.0, metavar="S")
    apply.add_argument("config", help="a JSON object, inline or in a file: any of mode, policy, k, pipeline, verifier, "
                                      "clouds (null clears one), version optional; merged into the group's config")
    apply.set_defaults(run=run_apply)
    push = programs.add_parser("push-verifier", help="publish a verifier and point a group's edges at it")
    add_broker_arguments(push, required=True)
    push.add_argument("--group", required=True)
    push.add_argument("--timeout", type=float, default=20.0, metavar="S")
    push.add_argument("directory", type=Path, help="holds verifier.json and the ONNX file it names")
    push.set_defaults(run=run_push_verifier)
    for entry in sorted(entry_points(group="sprinter.fleet_commands"), key=lambda e: e.name):
        try:
            entry.load()(programs)
        except (ImportError, AttributeError) as err:  # one broken program must not take the others down
            print(f"sprinter fleet: program {entry.name!r} is unavailable: {err}", file=sys.stderr)


def run_status(args: argparse.Namespace) -> int:
    settings = broker_settings(args)
    while True:
        snapshot = asyncio.run(read_fleet(settings))
        if args.json:
            print(json.dumps({"edges": snapshot.edges, "telemetry": snapshot.telemetry, "clouds": snapshot.clouds},
                             default=lambda m: m.__dict__, indent=1))
        else:
            print(format_status(snapshot), flush=True)
        if not args.watch:
            return 0
        try:
            asyncio.run(asyncio.sleep(args.watch))
        except KeyboardInterrupt:
            return 0
        print()


def _report(results: list, group: str) -> int:
    if not results:
        print(f"no edge of group {group} is online; the config is retained for those that come")
        return 0
    for r in results:
        latency = "-" if r.latency_ms is None else f"{r.latency_ms:.0f} ms"
        print(f"{r.edge_id}: {'applied' if r.ok else 'REFUSED'} ({latency}){'' if r.ok else ': ' + str(r.reason)}")
    return 0 if all(r.ok for r in results) else 1


def config_changes(text: str) -> dict[str, Any]:
    """`fleet apply`'s argument: inline JSON (an object) or the path of a file holding one; ValueError otherwise."""
    source, body = "the argument", text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"{text!r} is neither a JSON object nor a file: pass '{{\"mode\": \"sd\"}}' or a path")
        source, body = str(path), path.read_text()
    try:
        changes = json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source} is not valid JSON: {err}") from None
    if not isinstance(changes, dict):
        raise ValueError(f"{source} must hold a JSON object, not {type(changes).__name__}")
    changes.pop("schema", None)
    if "group" in changes and changes.pop("group") is not None:
        raise ValueError("the group is --group's, not the config's")
    return changes


def run_apply(args: argparse.Namespace) -> int:
    try:
        changes = config_changes(args.config)
        results = asyncio.run(apply_config(broker_settings(args), args.group, changes, args.timeout))
    except ValueError as err:
        print(f"sprinter fleet apply: {err}", file=sys.stderr)
        return 2
    return _report(results, args.group)


def run_push_verifier(args: argparse.Namespace) -> int:
    metadata = json.loads((args.directory / "verifier.json").read_text())
    artifact = VerifierArtifact.from_onnx((args.directory / metadata["onnx"]).read_bytes(), metadata)
    settings = broker_settings(args)
    asyncio.run(push_verifier(settings, artifact))
    verifier = {"id": metadata.get("id") or args.directory.name, "sha256": artifact.sha256}
    print(f"published verifier {verifier['id']} ({artifact.sha256[:12]}...)")
    results = asyncio.run(apply_config(settings, args.group, {"verifier": verifier}, args.timeout))
    return _report(results, args.group)
