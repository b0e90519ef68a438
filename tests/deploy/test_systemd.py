"""deploy/systemd: the units pass `systemd-analyze verify` and keep a low exposure score.

The units run Kiln from /opt/kiln (the install they document). `verify` checks that ExecStart's
program exists and is executable, so the units are checked as installed over this checkout's
virtual environment: /opt/kiln/bin/ becomes its bin/, which holds the same kiln-gateway and
kiln-worker the project builds. Anything `verify` reports (an unknown key, a bad value, a missing
program) fails the test: it exits 0 on most of them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import UNITS

INSTALL = "/opt/kiln/bin/"
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
# `systemd-analyze security` scores 0 (locked down) to 10 (exposed); 2 is its "OK" range's top.
MAX_EXPOSURE = 2.0


@pytest.fixture
def installed(tmp_path) -> list[Path]:
    bin_dir = Path(sys.prefix) / "bin"
    units = []
    for unit in UNITS:
        text = unit.read_text()
        assert f"ExecStart={INSTALL}" in text, f"{unit.name}: ExecStart must run Kiln from {INSTALL}"
        target = tmp_path / unit.name
        target.write_text(text.replace(INSTALL, f"{bin_dir}/"))
        units.append(target)
    return units


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=120)


def test_the_units_are_the_gateway_and_the_worker_template():
    assert [u.name for u in UNITS] == ["kiln-gateway.service", "kiln-worker@.service"]


def test_the_units_verify_without_a_single_complaint(installed):
    result = _analyze("verify", "--man=no", *map(str, installed))
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


@pytest.mark.parametrize("unit", [u.name for u in UNITS])
def test_the_units_are_hardened(installed, unit):
    result = _analyze("security", "--offline=yes", str(next(u for u in installed if u.name == unit)))
    assert result.returncode == 0, result.stderr
    score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)[1])
    assert score <= MAX_EXPOSURE, result.stdout


@pytest.mark.parametrize("unit", [u.name for u in UNITS])
def test_settings_come_from_an_environment_file_and_failures_restart(unit):
    text = next(u for u in UNITS if u.name == unit).read_text()
    assert re.search(r"^EnvironmentFile=/etc/kiln/\S+\.env$", text, re.M)
    assert "Restart=on-failure" in text and "RestartPreventExitStatus=2" in text  # 2: a usage error
    # The worker secret is a credential, never a line of an environment file.
    assert "LoadCredential=worker-secret:" in text and "KILN_WORKER_SECRET_FILE=%d/worker-secret" in text
