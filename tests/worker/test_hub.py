"""Hub ids: `org/name` resolves through a pre-populated Hugging Face cache offline, a GGUF repo
takes `:QUANT` file selection, and a missing id fails the worker's start naming the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support import Kiln, free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_repo(hf_home: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repo in huggingface_hub's cache layout: blobs, refs/main, snapshots/<commit>/ links."""
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for i, (name, source) in enumerate(files.items()):
        blob = root / "blobs" / f"{i:040x}"
        blob.symlink_to(source)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture()
def hf_home(tmp_path, gguf_path, monkeypatch) -> Path:
    home = tmp_path / "hf"
    _lay_out_repo(home, "kiln-test/smollm2", {gguf_path.name: gguf_path})
    _lay_out_repo(home, "kiln-test/smollm2-GGUF", {"smollm2.Q4_1.gguf": gguf_path, "smollm2.Q8_0.gguf": gguf_path})
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_hub_ids_resolve_from_the_cache_offline(hf_home):
    from kiln.worker.loading.hub import HubModelError, parse_hub_id, resolve

    assert resolve(parse_hub_id("kiln-test/smollm2")).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve(parse_hub_id("kiln-test/smollm2-GGUF:Q8_0")).name == "smollm2.Q8_0.gguf"
    assert resolve(parse_hub_id("kiln-test/smollm2-GGUF:q4_1")).name == "smollm2.Q4_1.gguf"
    with pytest.raises(HubModelError, match=r"several GGUF files .*choose one as kiln-test/smollm2-GGUF:<QUANT>"):
        resolve(parse_hub_id("kiln-test/smollm2-GGUF"))
    with pytest.raises(HubModelError, match="no GGUF file matching 'Q6_K'"):
        resolve(parse_hub_id("kiln-test/smollm2-GGUF:Q6_K"))
    with pytest.raises(HubModelError) as missing:
        resolve(parse_hub_id("kiln-test/absent"))
    assert str(hf_home / "hub") in str(missing.value) and "HF_HUB_OFFLINE=1" in str(missing.value)


def test_worker_serves_a_cached_hub_id_offline(hf_home, tmp_path):
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    kiln = Kiln(tmp_path, worker_args=["--model", "kiln-test/smollm2"], env=env).start()
    try:
        models = httpx.get(kiln.base_url + "/v1/models", timeout=10).json()["data"]
        assert "kiln-test/smollm2" in [m["id"] for m in models]
        r = httpx.post(kiln.base_url + "/v1/responses", timeout=120,
                       json={"model": "kiln-test/smollm2", "input": "Say hi.", "max_output_tokens": 8})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "kiln-test/smollm2"
        assert r.json()["output"][0]["content"][0]["text"]
    finally:
        kiln.stop()


def test_missing_hub_id_fails_the_start_naming_the_cache(hf_home, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    zmq = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "kiln.worker", "--gateway", zmq, "--model", "kiln-test/absent"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "kiln-test/absent is not in the Hugging Face cache at " + str(hf_home / "hub") in output
    assert "Traceback" not in output


def _kiln(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kiln", "models", *args], env=env, capture_output=True, text=True, timeout=60)


def test_models_list_pull_rm(hf_home):
    listed = _kiln(hf_home, "list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert any(line.startswith("kiln-test/smollm2\t") for line in lines)
    assert any(line.startswith("kiln-test/smollm2-GGUF\t") and "smollm2.Q4_1.gguf, smollm2.Q8_0.gguf" in line for line in lines)

    pulled = _kiln(hf_home, "pull", "kiln-test/smollm2-GGUF:Q8_0")  # cached: offline is fine
    assert pulled.returncode == 0 and pulled.stdout.strip().endswith("smollm2.Q8_0.gguf"), pulled.stderr
    absent = _kiln(hf_home, "pull", "kiln-test/absent")
    assert absent.returncode == 1 and "not in the Hugging Face cache at" in absent.stderr

    removed = _kiln(hf_home, "rm", "--yes", "kiln-test/smollm2-GGUF")
    assert removed.returncode == 0, removed.stderr
    assert not (hf_home / "hub" / "models--kiln-test--smollm2-GGUF").exists()
    assert "smollm2-GGUF" not in _kiln(hf_home, "list").stdout
    again = _kiln(hf_home, "rm", "--yes", "kiln-test/smollm2-GGUF")
    assert again.returncode == 1 and "is not in the cache" in again.stderr
