"""docs/configuration.md documents every setting: each command's table lists exactly its flags, each
with all the environment variables it reads and, for a choice, its choices. A flag added to a
settings dataclass without a row here (or a row left behind) fails this test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kiln.gateway.settings import Settings
from kiln.protocol.settings_fields import SettingField, setting_fields
from kiln.settings import ServeSettings
from kiln.worker.settings import WorkerSettings

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SECTIONS = {"`kiln serve`": ServeSettings, "`kiln-gateway`": Settings, "`kiln-worker`": WorkerSettings}


def rows(section: str) -> dict[str, tuple[str, list[str]]]:
    """flag -> (its first cell, the variables of its second) in the tables of one ``##`` section."""
    text = DOC.read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in body.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) >= 2 and cells[0].startswith("`--"):
            flag = cells[0].strip("`").split()[0]
            found[flag] = (cells[0], re.findall(r"`([A-Z0-9_]+)`", cells[1]))
    return found


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_flag_has_its_row(section):
    fields = {sf.flag: sf for sf in setting_fields(SECTIONS[section])}
    documented = rows(section)
    assert sorted(set(fields) - set(documented)) == [], "flags without a row"
    assert sorted(set(documented) - set(fields)) == [], "rows of flags that do not exist"
    for flag, (first, env) in documented.items():
        sf: SettingField = fields[flag]
        assert env == list(sf.env), flag
        if sf.choices is not None:  # written `--flag a\|b` (a pipe escaped in a table cell)
            assert first == "`" + flag + " " + "\\|".join(sf.choices) + "`", flag
