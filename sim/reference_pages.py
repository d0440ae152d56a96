"""`sprinter docs reference --out DIR`: the documentation site's reference pages, generated from the code.

    sprinter docs reference --out docs/reference

Writes three Markdown pages that `make docs` builds with the rest of docs/ (and never commits):
cli.md (every `sprinter` command and its options, walked from the real argparse parser), metrics.md
(every Prometheus metric the edge and the cloud expose, from their registries, built without starting
a server) and grpc.md (the gRPC contract: services, messages, fields and enums with the comments of
proto/sprinter/v1/decoding.proto, read from protoc's descriptor set with its source info).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
PROTO_FILE = "sprinter/v1/decoding.proto"
# FileDescriptorProto / DescriptorProto field numbers, as source_code_info paths name them.
MESSAGES, ENUMS, SERVICES = 4, 5, 6
MESSAGE_FIELDS, NESTED_MESSAGES, NESTED_ENUMS = 2, 3, 4
ENUM_VALUES, SERVICE_METHODS = 2, 2


def register(subcommands: argparse._SubParsersAction) -> None:
    p = subcommands.add_parser("docs", help="the documentation site's generated pages")
    pages = p.add_subparsers(dest="docs_command", required=True, metavar="PAGES")
    ref = pages.add_parser("reference", help="write the command, metric and gRPC reference pages",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ref.add_argument("--out", type=Path, default=Path("docs/reference"), help="directory for cli.md, metrics.md, grpc.md")
    ref.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    write_reference(args.out)
    log.info("wrote the reference pages into %s", args.out)
    return 0


def write_reference(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.md").write_text(cli_page())
    (out / "metrics.md").write_text(metrics_page())
    (out / "grpc.md").write_text(grpc_page())


def _paragraph(text: str) -> list[str]:
    return [text, ""] if text else []


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# ------------------------------------------------------------------------------------------ commands

def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def walk_commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("sprinter",)
                  ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command that runs something (a parser without subcommands), with the words that name it."""
    children = _subcommands(parser)
    if not children:
        yield words, parser
    for name, child in sorted(children.items()):
        yield from walk_commands(child, words + (name,))


def _option_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.choices is not None and not isinstance(action.choices, range):
        values = ", ".join(f"`{c}`" for c in action.choices)
    else:
        values = ""
    default = "" if action.default in (None, argparse.SUPPRESS) or action.option_strings == [] else f"`{action.default}`"
    helptext = action.help or ""
    if "%(" in helptext:  # argparse's own placeholders, %(default)s and the like
        helptext = helptext % {**vars(action), "prog": "sprinter"}
    return f"| {names} | {_cell(values)} | {_cell(default)} | {_cell(helptext)} |"


def command_section(words: tuple[str, ...], parser: argparse.ArgumentParser) -> str:
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]
    lines = [f"## {' '.join(words)}", ""]
    if parser.description:
        lines += [parser.description.strip().split("\n\n")[0].strip(), ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    if actions:
        lines += ["| option | values | default | what |", "| --- | --- | --- | --- |"]
        lines += [_option_row(a) for a in actions]
    return "\n".join(lines) + "\n"


def cli_page() -> str:
    from common.cli import build_parser

    commands = list(walk_commands(build_parser()))
    head = ["# Commands", "", "Generated from the `sprinter` parser by `make docs` "
            "(`sprinter docs reference`). Every program is a `sprinter` subcommand; `--log-level` goes before "
            "the command.", ""]
    head += [f"- [{' '.join(words)}](#{'-'.join(words)})" for words, _ in commands] + [""]
    return "\n".join(head) + "\n" + "\n".join(command_section(words, parser) for words, parser in commands)


# ------------------------------------------------------------------------------------------- metrics

@dataclass(frozen=True)
class MetricDoc:
    name: str
    kind: str
    labels: tuple[str, ...]
    help: str


def registry_metrics(registry: object) -> list[MetricDoc]:
    """Each family a registry exposes, labelled ones included before their first sample."""
    docs = []
    for family in registry.collect():  # type: ignore[attr-defined]
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {label for sample in family.samples for label in sample.labels if label not in ("le", "quantile")}
        labels |= set(getattr(family, "_labelnames", ()))  # a custom collector's family, declared without samples
        docs.append(MetricDoc(name, family.type, tuple(sorted(labels)), family.documentation))
    return docs


def _labels_from_collectors(registry: object) -> dict[str, tuple[str, ...]]:
    """Label names of prometheus_client's own metric objects, which show none before a sample."""
    names: dict[str, tuple[str, ...]] = {}
    for collector in getattr(registry, "_collector_to_names", {}):
        for name in getattr(registry, "_collector_to_names")[collector]:
            names[name] = tuple(getattr(collector, "_labelnames", ()))
    return names


def side_metrics() -> dict[str, list[MetricDoc]]:
    from cloud.metrics import CloudMetrics
    from common.spec.cost_model import CostModel
    from edge.api.metrics import EdgeMetrics

    sides = {"edge daemon (`sprinter edge serve`, `/metrics`)": EdgeMetrics(CostModel()).registry,
             "cloud service (`sprinter cloud serve --metrics-port`)": CloudMetrics().registry}
    found = {}
    for side, registry in sides.items():
        labels = _labels_from_collectors(registry)
        found[side] = sorted((MetricDoc(m.name, m.kind, m.labels or labels.get(m.name, ()), m.help)
                              for m in registry_metrics(registry)), key=lambda m: m.name)
    return found


def metrics_page() -> str:
    lines = ["# Metrics", "", "Generated from the Prometheus registries of the edge and the cloud by `make docs` "
             "(`sprinter docs reference`). Counters carry `_total`; a histogram also exposes `_bucket`, `_sum` "
             "and `_count`.", ""]
    for side, metrics in side_metrics().items():
        lines += [f"## The {side}", "", "| metric | type | labels | what |", "| --- | --- | --- | --- |"]
        lines += [f"| `{m.name}` | {m.kind} | {', '.join(f'`{x}`' for x in m.labels)} | {_cell(m.help)} |"
                  for m in metrics]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- gRPC

def descriptor_set() -> object:
    """proto/sprinter/v1/decoding.proto compiled by protoc, comments kept (source_code_info)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "decoding.pb"
        code = protoc.main(["protoc", f"-I{PROTO_ROOT}", "--include_source_info",
                            f"--descriptor_set_out={target}", str(PROTO_ROOT / PROTO_FILE)])
        if code != 0:
            raise RuntimeError(f"protoc could not compile {PROTO_FILE} (exit {code})")
        files = descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes())
    return next(f for f in files.file if f.name == PROTO_FILE)


def _comments(proto: object) -> dict[tuple[int, ...], str]:
    found = {}
    for location in proto.source_code_info.location:  # type: ignore[attr-defined]
        text = (location.leading_comments or location.trailing_comments).strip()
        if text:
            found[tuple(location.path)] = " ".join(line.strip() for line in text.splitlines())
    return found


def _type_name(field: object) -> str:
    from google.protobuf import descriptor_pb2

    kind = descriptor_pb2.FieldDescriptorProto
    name = field.type_name.rsplit(".", 1)[-1] if field.type_name else kind.Type.Name(field.type)[5:].lower()  # type: ignore[attr-defined]
    return f"repeated {name}" if field.label == kind.LABEL_REPEATED else name  # type: ignore[attr-defined]


def _enum_section(enum: object, path: tuple[int, ...], comments: dict[tuple[int, ...], str], prefix: str) -> list[str]:
    lines = [f"### enum {prefix}{enum.name}", "", *_paragraph(comments.get(path, "")),  # type: ignore[attr-defined]
             "| value | number | what |", "| --- | --- | --- |"]
    for i, value in enumerate(enum.value):  # type: ignore[attr-defined]
        lines.append(f"| `{value.name}` | {value.number} | {_cell(comments.get(path + (ENUM_VALUES, i), ''))} |")
    return lines + [""]


def _message_section(message: object, path: tuple[int, ...], comments: dict[tuple[int, ...], str],
                     prefix: str = "") -> list[str]:
    lines = [f"### {prefix}{message.name}", "", *_paragraph(comments.get(path, ""))]  # type: ignore[attr-defined]
    if message.field:  # type: ignore[attr-defined]
        lines += ["| field | number | type | what |", "| --- | --- | --- | --- |"]
        for i, field in enumerate(message.field):  # type: ignore[attr-defined]
            note = comments.get(path + (MESSAGE_FIELDS, i), "")
            lines.append(f"| `{field.name}` | {field.number} | `{_type_name(field)}` | {_cell(note)} |")
        lines.append("")
    for i, enum in enumerate(message.enum_type):  # type: ignore[attr-defined]
        lines += _enum_section(enum, path + (NESTED_ENUMS, i), comments, f"{prefix}{message.name}.")  # type: ignore[attr-defined]
    for i, nested in enumerate(message.nested_type):  # type: ignore[attr-defined]
        if not nested.options.map_entry:
            lines += _message_section(nested, path + (NESTED_MESSAGES, i), comments, f"{prefix}{message.name}.")  # type: ignore[attr-defined]
    return lines


def grpc_page() -> str:
    proto = descriptor_set()
    comments = _comments(proto)
    lines = ["# gRPC contract", "", f"Generated from `proto/{PROTO_FILE}` (package `{proto.package}`) and its "  # type: ignore[attr-defined]
             "comments by `make docs` (`sprinter docs reference`). How a Session stream runs: "
             "[the Session stream](../wire.md).", "", "## Services", ""]
    for s, service in enumerate(proto.service):  # type: ignore[attr-defined]
        lines += [f"### service {service.name}", "", *_paragraph(comments.get((SERVICES, s), "")),
                  "| method | request | response | what |", "| --- | --- | --- | --- |"]
        for m, method in enumerate(service.method):
            stream_in = "stream " if method.client_streaming else ""
            stream_out = "stream " if method.server_streaming else ""
            lines.append(f"| `{method.name}` | `{stream_in}{method.input_type.rsplit('.', 1)[-1]}` | "
                         f"`{stream_out}{method.output_type.rsplit('.', 1)[-1]}` | "
                         f"{_cell(comments.get((SERVICES, s, SERVICE_METHODS, m), ''))} |")
        lines.append("")
    lines += ["## Messages", ""]
    for i, message in enumerate(proto.message_type):  # type: ignore[attr-defined]
        lines += _message_section(message, (MESSAGES, i), comments)
    if proto.enum_type:  # type: ignore[attr-defined]
        lines += ["## Enums", ""]
    for i, enum in enumerate(proto.enum_type):  # type: ignore[attr-defined]
        lines += _enum_section(enum, (ENUMS, i), comments, "")
    return "\n".join(lines)
