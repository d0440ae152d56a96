"""deploy/'s compose files against the Compose Specification's own JSON schema (compose-spec, the schema `docker
compose` validates with), offline: `make compose-schema` fetches it from npm (the dclint package ships it) into
.cache/compose-spec/, and `make test` does so first. Each file is read as compose reads it: YAML anchors and merge keys
resolved, variables interpolated with their defaults (tests/deploy/test_deploy.py's compose_value)."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_deploy import DEPLOY, ROOT, compose_value, missing

try:
    import jsonschema
except ImportError:  # the test extra brings it
    jsonschema = None

SCHEMA = ROOT / ".cache" / "compose-spec" / "compose-spec.json"
COMPOSE_FILES = sorted(p for pattern in ("**/compose*.y*ml", "**/docker-compose*.y*ml") for p in DEPLOY.glob(pattern))


@cache
def validator() -> "jsonschema.Draft7Validator":
    if jsonschema is None:
        missing("jsonschema is not installed (the test extra brings it)")
    if not SCHEMA.exists():
        missing(f"{SCHEMA.relative_to(ROOT)} is missing: run `make compose-schema` (make test does)")
    schema = json.loads(SCHEMA.read_text())
    # compose-spec names draft 07 as "https://json-schema.org/draft-07/schema", an id jsonschema does not know
    assert "draft-07" in schema["$schema"], schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(document: dict) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                  for e in validator().iter_errors(document))


def loaded(path: Path) -> dict:
    return compose_value(yaml.safe_load(path.read_text()))


def test_deploy_has_compose_files() -> None:
    assert [p.relative_to(DEPLOY).as_posix() for p in COMPOSE_FILES] == ["compose/compose.yaml"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_compose_file_validates_against_the_compose_spec(path: Path) -> None:
    assert errors(loaded(path)) == []


# (what is planted, where it lands, the path the schema's error names)
PLANTED = [("a misspelt service key", lambda d: d["services"]["edge-a"].update(healthchek={}), "services/edge-a"),
           ("an unknown dependency condition",
            lambda d: d["services"]["grafana"]["depends_on"]["prometheus"].update(condition="service_healty"),
            "services/grafana/depends_on"),
           ("ports as a mapping", lambda d: d["services"]["edge-a"].update(ports={"8001": 8000}),
            "services/edge-a/ports"),
           ("an unknown top-level key", lambda d: d.update(service={}), "(top)")]


@pytest.mark.parametrize("what, plant, where", PLANTED, ids=[p[0] for p in PLANTED])
def test_the_schema_rejects_a_planted_error(what: str, plant, where: str) -> None:
    document = copy.deepcopy(loaded(DEPLOY / "compose" / "compose.yaml"))
    plant(document)
    found = errors(document)
    assert found, f"{what} passed the schema"
    assert any(error.startswith(where) for error in found), found
