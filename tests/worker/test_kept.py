"""Records kept across starts (worker/engine/kept.py): what both start-time checks rely on."""

from kiln.worker.native.kept import KeptJson


def test_a_record_is_kept_and_replaced(tmp_path):
    kept = KeptJson(tmp_path / "checks")
    assert kept.get("abc") is None  # nothing kept yet, and no folder either
    kept.put("abc", {"agrees": True})
    kept.put("abc", {"agrees": False})
    assert kept.get("abc") == {"agrees": False}
    assert [p.name for p in (tmp_path / "checks").iterdir()] == ["abc.json"]


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    """Where the rename fails (here: a folder stands where the file goes), the next start
    checks again and the folder does not fill with half-written files."""
    (tmp_path / "abc.json").mkdir()
    kept = KeptJson(tmp_path)
    kept.put("abc", {"agrees": True})
    assert kept.get("abc") is None
    assert [p.name for p in tmp_path.iterdir()] == ["abc.json"]


def test_a_damaged_record_reads_as_none(tmp_path):
    (tmp_path / "abc.json").write_text('{"agrees": tr')
    (tmp_path / "list.json").write_text("[1, 2]")
    kept = KeptJson(tmp_path)
    assert kept.get("abc") is None and kept.get("list") is None
