"""The design's boundaries, checked on the source: the gateway never imports the worker or mlx,
the worker never imports the gateway or speaks HTTP, and ``protocol/`` (the only code both import)
imports neither daemon. A change that crosses a boundary fails here, not in a deployment where
the gateway host has no mlx. One exception, by name: the upstream engine's client
(worker/upstream/client.py) is an HTTP client of the engine it drives (vLLM, SGLang,
llama-server); the worker still serves no HTTP."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "gateway": ("kiln.worker", "mlx", "mlx_lm", "llguidance.mlx"),
    "worker": ("kiln.gateway", "starlette", "hypercorn", "httpx"),
    "protocol": ("kiln.gateway", "kiln.worker", "mlx", "mlx_lm", "starlette", "hypercorn"),
}


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (relative imports stay inside their package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


# The daemons' packages; anything else under ``kiln.`` is the umbrella command (kiln/), which the
# daemons must not import back: code they share lives in protocol/.
DAEMON_PACKAGES = ("kiln.gateway", "kiln.worker", "kiln.protocol")


# (file, module) pairs allowed across a boundary, each for the reason in the docstring above.
ALLOWED = {("worker/upstream/client.py", "httpx")}


def _crossings(folder: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported_modules(path):
            if (str(path.relative_to(ROOT)), name) in ALLOWED:
                continue
            for prefix in FORBIDDEN[folder]:
                if name == prefix or name.startswith(prefix + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if (name == "kiln" or name.startswith("kiln.")) and not name.startswith(DAEMON_PACKAGES):
                bad.append(f"{path.relative_to(ROOT)} imports the umbrella {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_crosses_a_boundary(folder):
    assert _crossings(folder) == []


def test_the_checker_sees_a_crossing(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import mlx.core as mx\nfrom kiln.worker.engine import scheduler\nfrom . import sibling\n")
    assert imported_modules(bad) == {"mlx.core", "kiln.worker.engine"}
