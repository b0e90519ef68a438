"""deploy/compose.yaml: valid against the Compose Specification's JSON schema (vendored, see
schemas/README.md), and the reference topology it promises."""

from __future__ import annotations

import copy
import json
import re

import jsonschema

from tests.deploy.files import COMPOSE, DEPLOY, SCHEMAS, compose, role
from tests.support import REPO

# Settings whose value is a secret: given only as a file (`*_FILE`) in deploy/.
SECRET_SETTINGS = {"KILN_WORKER_SECRET", "KILN_ADMIN_TOKEN", "KILN_SECRET_KEY", "KILN_DATABASE_URL", "POSTGRES_PASSWORD"}


def _services(kind: str) -> dict[str, dict]:
    return {name: s for name, s in compose()["services"].items() if role(s.get("command")) == kind}


def _errors(document: dict) -> list[str]:
    # The schema declares draft-07 (its "$schema" spells the URI without the "#" jsonschema keys on).
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    return [f"{COMPOSE.name} at {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_file_matches_the_compose_specification():
    assert _errors(compose()) == []


def test_the_schema_catches_a_misspelt_key():
    """The check is worth something: a typo in a service is an error, not an ignored key."""
    broken = copy.deepcopy(compose())
    broken["services"]["gateway-1"]["enviroment"] = broken["services"]["gateway-1"].pop("environment")
    assert any("enviroment" in error for error in _errors(broken))


def test_the_reference_topology():
    services = compose()["services"]
    assert len(_services("gateway")) == 2 and len(_services("worker")) == 2
    assert {"haproxy", "redis", "postgres"} <= set(services)
    # Only the load balancer is published; gateways, workers and the stores stay inside.
    assert [name for name, s in services.items() if s.get("ports")] == ["haproxy"]
    mount = services["haproxy"]["volumes"][0].split(":")[0]
    assert (COMPOSE.parent / mount).resolve() == DEPLOY / "haproxy" / "haproxy.cfg"


def test_every_worker_serves_every_gateway():
    gateways = _services("gateway")
    ports = {name: re.search(r":(\d+)$", s["environment"]["KILN_WORKERS_BIND"])[1] for name, s in gateways.items()}
    for name, worker in _services("worker").items():
        command = worker["command"]
        addresses = [command[i + 1] for i, arg in enumerate(command) if arg == "--gateway"]
        assert sorted(addresses) == sorted(f"tcp://{g}:{port}" for g, port in ports.items()), name


def test_shared_settings_are_the_same_on_every_gateway():
    """One deployment: the replicas must agree on where state lives and how it is keyed."""
    envs = [s["environment"] for s in _services("gateway").values()]
    assert all(env == envs[0] for env in envs)
    assert envs[0]["KILN_STORE"] == "redis" and envs[0]["KILN_AUTH"] == "keys"


def test_secrets_are_files_never_values():
    declared = compose()["secrets"]
    for name, service in compose()["services"].items():
        for key, value in (service.get("environment") or {}).items():
            assert key not in SECRET_SETTINGS, f"{name}: {key} given as a value; use {key}_FILE"
            assert not re.search(r"://[^/@]+:[^/@]+@", str(value)), f"{name}: {key} holds a password"
            if key.endswith("_FILE"):
                secret = value.removeprefix("/run/secrets/")
                assert secret in service["secrets"] and secret in declared, (name, key)
    for secret in declared.values():
        assert secret["file"].startswith("./secrets/")
    # Where the operator writes them is never committed.
    assert "deploy/secrets/" in (REPO / ".gitignore").read_text().splitlines()
