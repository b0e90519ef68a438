"""deploy/upstream/: Kiln in front of vLLM (GPU) and llama-server (CPU), for Compose and
Kubernetes. The same checks as the reference files' (the vendored Compose and strict Kubernetes
schemas, every worker setting parsed by kiln-worker's own CLI), and the wiring docs/upstream.md
describes: each upstream worker names an engine defined beside it, on the port it listens on, as
the kind it is."""

from __future__ import annotations

import re

import pytest

from tests.deploy.files import DEPLOY, role, yaml_documents
from tests.deploy.test_compose import _errors as compose_errors
from tests.deploy.test_kubernetes import _errors as kubernetes_errors
from tests.deploy.test_settings import _by_env, _parse, _split_flags, worker_cli

COMPOSE = DEPLOY / "upstream" / "compose.yaml"
KUBERNETES = DEPLOY / "upstream" / "k8s.yaml"
BASE_CONFIG_MAPS = DEPLOY / "k8s" / "configmap.yaml"
KINDS = {"vllm/vllm-openai": "vllm", "ghcr.io/ggml-org/llama.cpp": "llama-server"}


def _compose() -> dict:
    return yaml_documents(COMPOSE)[0]


def _manifests() -> list[dict]:
    return yaml_documents(KUBERNETES)


def _workers() -> list[tuple[str, tuple[str, ...], dict[str, str]]]:
    """(where, args, environment) of every Kiln worker the two files start."""
    out = [(f"compose:{name}", tuple(s["command"][1:]), {k: str(v) for k, v in s["environment"].items()}) for name, s in _compose()["services"].items() if role(s.get("command")) == "worker"]
    maps = {d["metadata"]["name"]: d["data"] for d in [*_manifests(), *yaml_documents(BASE_CONFIG_MAPS)] if d["kind"] == "ConfigMap"}
    for doc in _manifests():
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if role(c.get("args")) == "worker":
                    env = {k: str(v) for ref in c["envFrom"] for k, v in maps[ref["configMapRef"]["name"]].items()}
                    env |= {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                    out.append((f"k8s:{doc['metadata']['name']}", tuple(c["args"][1:]), env))
    return out


def _engines() -> dict[str, tuple[str, int]]:
    """host name -> (engine kind, port), for both files."""
    out = {}
    for name, s in _compose()["services"].items():
        kind = next((k for image, k in KINDS.items() if s["image"].startswith(image)), None)
        if kind:
            out[f"compose:{name}"] = (kind, int(s["expose"][0]))
    pods = {d["metadata"]["name"]: d for d in _manifests() if d["kind"] == "Deployment"}
    for svc in (d for d in _manifests() if d["kind"] == "Service"):
        container = pods[svc["metadata"]["name"]]["spec"]["template"]["spec"]["containers"][0]
        kind = next(k for image, k in KINDS.items() if container["image"].startswith(image))
        out[f"k8s:{svc['metadata']['name']}"] = (kind, svc["spec"]["ports"][0]["port"])
    return out


def test_the_compose_file_matches_the_compose_specification():
    assert compose_errors(_compose()) == []


@pytest.mark.parametrize("doc", _manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_object_matches_its_kubernetes_schema(doc):
    assert kubernetes_errors(doc) == []


def test_every_worker_setting_exists_and_takes_its_value(tmp_path):
    stand_in = tmp_path / "file"
    stand_in.write_text("stand-in\n")
    problems = []
    for where, args, env in _workers():
        for name, value in env.items():
            param = _by_env(worker_cli, name)
            _, error = (None, f"no worker setting reads {name}") if param is None else _parse(worker_cli, param, [], {name: value}, str(stand_in))
            problems += [f"{where}: {name}: {error}"] if error else []
        _, unknown = _split_flags(worker_cli, args)
        problems += [f"{where}: unknown flag {flag}" for flag in unknown]
    assert problems == []


def test_each_upstream_worker_names_an_engine_beside_it_as_its_kind():
    engines = _engines()
    workers = _workers()
    assert {w[0].split(":")[0] for w in workers} == {"compose", "k8s"} and len(workers) == 4
    for where, _, env in workers:
        assert env["KILN_ENGINE"] == "upstream", where
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", env["KILN_UPSTREAM"]).groups()
        key = f"{where.split(':')[0]}:{host}"
        assert key in engines, f"{where}: no engine {host} in the same file"
        assert engines[key] == (env["KILN_UPSTREAM_KIND"], int(port)), where
