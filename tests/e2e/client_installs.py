"""Pinned third-party clients installed at test time into a cache, not into the project's
environment (they are heavy, or npm packages): ``npm install --prefix`` and ``pip install
--target``. A test whose client cannot be installed (no npm, offline, registry refused) is
skipped with the installer's own reason, never failed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

INSTALL_TIMEOUT = 900


def cache_root() -> Path:
    """$XDG_CACHE_HOME/kiln (or ~/.cache/kiln): one folder per pinned client set under it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"


def npm_install(prefix: Path, specs: list[str]) -> None:
    """``npm install`` the exact ``specs`` (name@version) into ``prefix``; skips the calling test
    when npm is missing or the install fails."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed, so {' '.join(specs)} cannot be installed (cache: {prefix})")
    prefix.mkdir(parents=True, exist_ok=True)
    _run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--no-save", *specs], f"npm install {' '.join(specs)}")


def pip_target(target: Path, specs: list[str]) -> Path:
    """The folder holding ``specs`` (name==version) and their dependencies, installed once with
    ``pip install --target``; a subprocess gets it on PYTHONPATH, so none of it can shadow the
    project's own packages in the test process. Skips the calling test when the install fails."""
    done = target / ".installed"
    if done.exists() and done.read_text() == "\n".join(specs):
        return target
    if target.exists():
        shutil.rmtree(target)  # a half-finished or older install
    target.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target", str(target), *specs], f"pip install {' '.join(specs)}")
    done.write_text("\n".join(specs))
    return target


def _run(argv: list[str], what: str) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{what} timed out after {INSTALL_TIMEOUT} s")
    if result.returncode != 0:
        pytest.skip(f"{what} failed (rc {result.returncode}): {result.stderr.strip()[-600:]}")
