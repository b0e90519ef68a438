"""The deploy/ files, read once for the checks in tests/deploy/ (none of which needs a container
engine). Each check says which file and which place it judges, so a failure names what to fix."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

DEPLOY = REPO / "deploy"
SCHEMAS = Path(__file__).with_name("schemas")
COMPOSE = DEPLOY / "compose.yaml"
KUBERNETES = sorted((DEPLOY / "k8s").glob("*.yaml"))
HAPROXY = DEPLOY / "haproxy" / "haproxy.cfg"
DOCKERFILE = DEPLOY / "Dockerfile"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


@cache
def _documents(path: Path) -> tuple[Any, ...]:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


def yaml_documents(path: Path) -> list[Any]:
    """The YAML documents of a file, anchors and merge keys (<<) resolved as Compose and
    Kubernetes resolve them."""
    return list(_documents(path))


def compose() -> dict[str, Any]:
    return yaml_documents(COMPOSE)[0]


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object in deploy/k8s, with its file."""
    return [(path, doc) for path in KUBERNETES for doc in yaml_documents(path)]


def role(command: list[str] | None) -> str | None:
    """"gateway" or "worker" for a container command of the image (deploy/docker/entrypoint.sh)."""
    if command and command[0] in ("gateway", "worker"):
        return command[0]
    return None
