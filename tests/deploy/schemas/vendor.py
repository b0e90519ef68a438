"""Refresh the vendored schemas (see README.md here): copy the Kubernetes kinds deploy/k8s uses from
kubernetes-validate's schema tree, with their shared definitions pruned to what those kinds reach,
and the Compose Specification's schema.

    pip download --no-deps kubernetes-validate==VERSION && unzip kubernetes_validate-*.whl -d kv
    python tests/deploy/schemas/vendor.py kv/kubernetes_validate/kubernetes-json-schema/vX.Y.0-local-strict \
        path/to/compose-spec/schema/compose-spec.json

Not run by the tests; they read what this wrote.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The kinds in deploy/k8s, as kubernetes-validate names their files.
KINDS = [
    "configmap-v1",
    "service-v1",
    "deployment-apps-v1",
    "statefulset-apps-v1",
    "horizontalpodautoscaler-autoscaling-v2",
    "poddisruptionbudget-policy-v1",
]
_REF = re.compile(r'"\$ref":\s*"[^"#]*#/\$defs/([^"]+)"')


def prune(definitions: dict, roots: list[str]) -> dict:
    """The definitions reachable from `roots` through $ref, everything else left out."""
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        todo.extend(_REF.findall(json.dumps(definitions["$defs"][name])))
    return {**definitions, "$defs": {name: definitions["$defs"][name] for name in sorted(keep)}}


def main(kubernetes_dir: str, compose_schema: str) -> None:
    source = Path(kubernetes_dir)
    target = HERE / "kubernetes" / source.name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    roots: list[str] = []
    for kind in KINDS:
        text = (source / f"{kind}.json").read_text()
        roots += _REF.findall(text)
        (target / f"{kind}.json").write_text(text)
    definitions = json.loads((source / "_definitions.json").read_text())
    (target / "_definitions.json").write_text(json.dumps(prune(definitions, roots), indent=1) + "\n")
    shutil.copyfile(compose_schema, HERE / "compose-spec.json")


if __name__ == "__main__":
    main(*sys.argv[1:])
