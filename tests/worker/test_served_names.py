"""The names a worker will register, known before it loads anything: ``kiln serve`` hands them
to the gateway so that requests for them answer 503 model_loading, not 404, while it loads. The
e2e first-run test shows the bundled model registering under exactly these names."""

from __future__ import annotations

from kiln.worker.cli import served_names
from kiln.worker.loading.loader import BUNDLED_MODEL_ID, model_names
from kiln.worker.settings import WorkerSettings


def test_names_without_loading(tmp_path):
    assert model_names(None) == (BUNDLED_MODEL_ID, [BUNDLED_MODEL_ID])
    gguf = tmp_path / "Qwen3-4B-Q8_0.gguf"
    gguf.write_bytes(b"")  # never read
    assert model_names(str(gguf)) == ("qwen3-4b-q8_0", ["qwen3-4b-q8_0"])
    model_id, aliases = model_names("mlx-community/Qwen3-4B-4bit")
    assert model_id == "mlx-community/Qwen3-4B-4bit" and "qwen3-4b-4bit" in aliases


def test_the_worker_settings_add_their_id_and_aliases():
    assert served_names(WorkerSettings()) == (BUNDLED_MODEL_ID, [BUNDLED_MODEL_ID])
    assert served_names(WorkerSettings(model_id="small", model_alias=("tiny",))) == ("small", sorted({"small", "tiny", BUNDLED_MODEL_ID}))
    assert served_names(WorkerSettings(engine="scripted")) == ("kiln-scripted", [])
    assert served_names(WorkerSettings(engine="scripted", model_id="m", model_alias=("a",))) == ("m", ["a"])
