"""The key that seals reasoning across restarts (kiln/state.py) and the two seal formats
(gateway/lifecycle/sealing.py): signed ``kiln1`` and encrypted ``kiln2`` (AES-256-GCM), in process."""

from __future__ import annotations

import base64
import json
import os
import stat

import pytest

from kiln.gateway.lifecycle.compaction import compaction_item, read_compaction
from kiln.gateway.http.errors import ApiError
from kiln.gateway.lifecycle.sealing import SealError, Sealer
from kiln.state import KEY_FILE, StateError, default_data_dir, sealing_key


def test_key_file_is_made_once_readable_by_its_owner_only(tmp_path):
    data = tmp_path / "data"
    key = sealing_key(data)
    path = data / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert len(key) == 64 and int(key, 16) >= 0
    assert sealing_key(data) == key  # the next start reads the same key
    assert [p.name for p in data.iterdir()] == [KEY_FILE]  # no temporary file left behind


def test_a_key_file_others_can_read_is_refused(tmp_path):
    sealing_key(tmp_path)
    os.chmod(tmp_path / KEY_FILE, 0o644)
    with pytest.raises(StateError, match="chmod 600"):
        sealing_key(tmp_path)


def test_an_empty_key_file_is_refused(tmp_path):
    (tmp_path / KEY_FILE).write_text("")
    os.chmod(tmp_path / KEY_FILE, 0o600)
    with pytest.raises(StateError, match="holds no key"):
        sealing_key(tmp_path)


def test_default_data_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "kiln"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / ".local" / "share" / "kiln"


def test_a_sealed_blob_survives_a_new_sealer_with_the_same_key(tmp_path):
    key = sealing_key(tmp_path)
    blob = Sealer(key).seal("reasoning", {"text": "think"})
    assert Sealer(key).unseal("reasoning", blob) == {"text": "think"}
    with pytest.raises(SealError):
        Sealer("another key").unseal("reasoning", blob)


def _flip(blob: str, part: int) -> str:
    pieces = blob.split(".")
    raw = bytearray(base64.urlsafe_b64decode(pieces[part] + "=" * (-len(pieces[part]) % 4)))
    raw[len(raw) // 2] ^= 1
    pieces[part] = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    return ".".join(pieces)


def test_encrypted_reasoning_round_trips_and_cannot_be_read():
    sealer = Sealer("k" * 32, encrypt=True)
    text = "The user's secret plan: reasoning nobody should read."
    blob = sealer.seal("reasoning", {"text": text})
    assert blob.startswith("kiln2.")
    assert sealer.unseal("reasoning", blob) == {"text": text}
    assert sealer.seal("reasoning", {"text": text}) != blob  # a fresh nonce each time
    # Nothing of the text shows in the blob, decoded or not.
    decoded = b"".join(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)) for p in blob.split(".")[1:])
    assert b"secret" not in decoded and "secret" not in blob


def test_tampered_encrypted_reasoning_is_rejected():
    sealer = Sealer("k" * 32, encrypt=True)
    blob = sealer.seal("reasoning", {"text": "t"})
    for bad in (_flip(blob, 1), _flip(blob, 2), blob[:-4], "kiln2.AAAA.BBBB", "kiln2.x"):
        with pytest.raises(SealError):
            sealer.unseal("reasoning", bad)
    with pytest.raises(SealError):
        Sealer("other" * 8, encrypt=True).unseal("reasoning", blob)  # another key
    with pytest.raises(SealError):
        sealer.unseal("compaction", blob)  # sealed as another kind


def test_either_format_is_read_whichever_is_made():
    key = "k" * 32
    signed, encrypted = Sealer(key).seal("reasoning", {"text": "a"}), Sealer(key, encrypt=True).seal("reasoning", {"text": "b"})
    for sealer in (Sealer(key), Sealer(key, encrypt=True)):
        assert sealer.unseal("reasoning", signed) == {"text": "a"}
        assert sealer.unseal("reasoning", encrypted) == {"text": "b"}
    with pytest.raises(SealError, match="signature"):
        Sealer(key).unseal("reasoning", _flip(signed, 1))


def test_compaction_content_is_readable_client_data():
    item = compaction_item("a summary", [{"type": "message", "role": "user", "content": "q"}])
    content = item["encrypted_content"]
    assert json.loads(base64.urlsafe_b64decode(content + "=" * (-len(content) % 4)))["summary"] == "a summary"
    summary, retained = read_compaction(content, "input[0].encrypted_content")
    assert summary == "a summary" and retained == [{"type": "message", "role": "user", "content": "q"}]
    # An item made by an older Kiln (kiln1.<body>.<signature>) is read without its signature.
    body = base64.urlsafe_b64encode(json.dumps({"summary": "old", "retained": []}).encode()).decode().rstrip("=")
    assert read_compaction(f"kiln1.{body}.bm90LWNoZWNrZWQ", "p") == ("old", [])
    with pytest.raises(ApiError) as refused:
        read_compaction("%%%", "input[3].encrypted_content")
    assert refused.value.status == 400 and refused.value.param == "input[3].encrypted_content"
