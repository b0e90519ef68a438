"""deploy/k8s: every object valid against the Kubernetes schema of its kind (the strict ones, which
refuse unknown fields; vendored, see schemas/README.md), and wired together as docs/deploy.md
says: workers reach every gateway replica the autoscaler can make, probes on /health, secrets
and config only by reference."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import jsonschema
import pytest
from dockerfile_parse import DockerfileParser
from referencing import Registry, Resource

from tests.deploy.files import DOCKERFILE, KUBERNETES, SCHEMAS, manifests, role

VERSION = "v1.33.0-local-strict"
KIND_SCHEMAS = SCHEMAS / "kubernetes" / VERSION


@cache
def _registry() -> Registry:
    definitions = json.loads((KIND_SCHEMAS / "_definitions.json").read_text())
    return Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))


def _schema_file(doc: dict) -> Path:
    group, _, version = doc["apiVersion"].rpartition("/")
    name = f"{doc['kind'].lower()}-{group.split('.')[0]}-{version}.json" if group else f"{doc['kind'].lower()}-{version}.json"
    return KIND_SCHEMAS / name


def _errors(doc: dict) -> list[str]:
    path = _schema_file(doc)
    if not path.is_file():
        return [f"no vendored schema for {doc['apiVersion']} {doc['kind']} ({path.name}): add it with schemas/vendor.py"]
    validator = jsonschema.Draft202012Validator(json.loads(path.read_text()), registry=_registry())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _one(kind: str, name: str) -> dict:
    [doc] = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _containers() -> list[tuple[str, dict, dict]]:
    """(role, container, pod spec) of every workload."""
    out = []
    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            out += [(role(c.get("args")), c, pod) for c in pod["containers"]]
    return out


@pytest.mark.parametrize("path,doc", manifests(), ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in manifests()])
def test_every_object_matches_its_kubernetes_schema(path, doc):
    assert _errors(doc) == [], path.name


def test_the_strict_schema_catches_a_misspelt_field():
    probe = copy.deepcopy(_one("StatefulSet", "kiln-gateway"))
    probe["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    assert any("readynessProbe" in e for e in _errors(probe))


def test_the_kinds_the_brief_asks_for():
    kinds = {(d["kind"], role([d["metadata"]["labels"]["app.kubernetes.io/component"]])) for _, d in manifests()}
    assert {("StatefulSet", "gateway"), ("Service", "gateway"), ("HorizontalPodAutoscaler", "gateway"), ("PodDisruptionBudget", "gateway"),
            ("Deployment", "worker"), ("PodDisruptionBudget", "worker"), ("ConfigMap", "gateway"), ("ConfigMap", "worker")} <= kinds  # fmt: skip


def test_workers_reach_every_gateway_replica_the_autoscaler_can_make():
    gateways = _one("StatefulSet", "kiln-gateway")
    headless = _one("Service", gateways["spec"]["serviceName"])
    autoscaler = _one("HorizontalPodAutoscaler", "kiln-gateway")
    assert autoscaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kiln-gateway"}
    # Headless, and publishing replicas before they are ready: a replica is ready only once a
    # worker registered with it, which needs its name first.
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    [port] = headless["spec"]["ports"]
    bind_port = re.search(r":(\d+)$", _one("ConfigMap", "kiln-gateway")["data"]["KILN_WORKERS_BIND"])[1]
    assert str(port["port"]) == bind_port
    names = _one("ConfigMap", "kiln-worker")["data"]["KILN_GATEWAY"].split(",")
    expected = [f"tcp://kiln-gateway-{i}.{headless['metadata']['name']}:{bind_port}" for i in range(autoscaler["spec"]["maxReplicas"])]
    assert names == expected
    assert autoscaler["spec"]["minReplicas"] >= 2 and gateways["spec"]["replicas"] >= 2


def test_gateway_probes_ask_health():
    [(_, gateway, _)] = [c for c in _containers() if c[0] == "gateway"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Liveness also asks /health, accepting 503 "no workers" (deploy/docker/healthcheck.py).
    assert gateway["livenessProbe"]["exec"]["command"] == ["python", "/opt/kiln/healthcheck.py"]


def test_pods_run_as_the_images_non_root_user():
    user = DockerfileParser(str(DOCKERFILE)).structure
    uid = int([i["value"] for i in user if i["instruction"] == "USER"][-1].split(":")[0])
    for kind, container, pod in _containers():
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid, kind
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_config_and_secrets_are_referenced_never_inlined():
    """ConfigMaps are defined here or made by a `kubectl create configmap` the files show; the one
    Secret is made by the `kubectl create secret` they show, with every key the pods read."""
    text = "\n".join(p.read_text() for p in KUBERNETES)
    defined = {d["metadata"]["name"] for _, d in manifests() if d["kind"] == "ConfigMap"}
    created = set(re.findall(r"kubectl create configmap (\S+)", text))
    secret_keys = set(re.findall(r"--from-file=([\w-]+)=", text))
    assert not [d for _, d in manifests() if d["kind"] == "Secret"]
    for _kind, container, pod in _containers():
        for volume in pod["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in defined | created, volume
            if "secret" in volume:
                assert volume["secret"]["secretName"] in re.findall(r"kubectl create secret generic (\S+)", text)
                assert {i["key"] for i in volume["secret"].get("items", [])} <= secret_keys
        for ref in container.get("envFrom", []):
            assert ref["configMapRef"]["name"] in defined
        for env in container.get("env", []):
            if env["name"].endswith("_FILE"):
                assert Path(env["value"]).name in secret_keys, env
