"""``./dev lint`` type-checks across Kiln's packages: a cross-package type error fails it.

``kiln.gateway`` lives in ``gateway/`` (setup.py's package_dir), which mypy cannot follow by
itself; with ``ignore_missing_imports`` every ``kiln.*`` import used to be ``Any`` to it, and a
gateway line assigning a ``kiln.protocol`` request to an ``int`` passed. Here a copy of the
checkout gets exactly that line planted, and ``./dev lint`` run in the copy must fail naming it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANT = '\nbad: int = GenerateRequest(model="m")\n'


def checkout_copy(tmp: Path) -> Path:
    """The product folders and the files ``./dev`` reads, beside the checkout's own .venv."""
    copy = tmp / "kiln"
    for folder in ("gateway", "worker", "protocol", "kiln"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "bundled-model.txt", "dev"):
        shutil.copy2(ROOT / name, copy / name)
    for folder in ("bench", "tests"):  # ruff's paths; their contents are not what this checks
        (copy / folder).mkdir()
    (copy / ".venv").symlink_to(ROOT / ".venv")
    return copy


def test_a_planted_cross_package_type_error_fails_dev_lint(tmp_path):
    copy = checkout_copy(tmp_path)
    target = copy / "gateway" / "pool" / "worker_request.py"
    target.write_text(target.read_text() + PLANT)
    run = subprocess.run(["./dev", "lint"], cwd=copy, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0, run.stdout + run.stderr
    assert 'gateway/pool/worker_request.py' in run.stdout and '"GenerateRequest", variable has type "int"' in run.stdout, run.stdout
