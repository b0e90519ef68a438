"""The design's boundaries, checked on the source: the gateway never imports the worker or mlx,
the worker never imports the gateway or speaks HTTP, and ``protocol/`` (the only code both import)
imports neither daemon. A change that crosses a boundary fails here, not in a deployment where
the gateway host has no mlx. One exception, by name: the upstream engine's client
(worker/upstream/client.py) is an HTTP client of the engine it drives (vLLM, SGLang,
llama-server); the worker still serves no HTTP.

Inside each daemon the tree is the architecture (docs/architecture.md): no module imports one that
imports it back, however indirectly (a loop forces lazy imports and hides which concern depends on
which), and an ``__init__.py`` holds no logic, so that a module's code is where its name says."""

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


def module_name(path: Path) -> str:
    """The import name of a file under ROOT (``gateway/http/app.py`` is ``kiln.gateway.http.app``)."""
    parts = ["kiln", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folder: str) -> dict[str, set[str]]:
    """Each module of ``folder`` and the modules of the same folder it imports (function-level and
    TYPE_CHECKING imports included: a loop through them is still a loop)."""
    files = {module_name(path): path for path in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                submodules = {f"{target}.{alias.name}" for alias in node.names} & files.keys()
                found |= submodules or ({target} & files.keys())
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names} & files.keys()
        graph[name] = found - {name}
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    loops.append(sorted(group))
    return loops


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_loops(folder):
    assert import_loops(import_graph(folder)) == []


def test_the_checker_sees_a_loop():
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def logic_in(path: Path) -> list[str]:
    """What an ``__init__.py`` runs beyond its docstring, imports and constant names: any
    function, class, branch, loop or call."""
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign)
    bad = [f"line {node.lineno}: {type(node).__name__}" for node in tree.body[1 if ast.get_docstring(tree) is not None else 0 :] if not isinstance(node, allowed)]
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(isinstance(sub, (ast.Call, ast.Lambda)) for sub in ast.walk(node)):
            bad.append(f"line {node.lineno}: a call")
    return bad


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_logic_in_init_files(folder):
    assert {str(path.relative_to(ROOT)): logic_in(path) for path in (ROOT / folder).rglob("__init__.py") if logic_in(path)} == {}
