"""Small JSON records kept across worker starts, one file per key, under the native cache folder.

Why: two start-time checks cost most of a second to many seconds of every start and depend only on
what they compare, so each remembers its answer: the native pass's build check
(``native_verdict``) and the agreement check of the fast exp (``cpu_exp``); the kept panels'
index is one too (``loading/panel_cache``). All need the same care, kept here once: a record is written beside its file and renamed, so two workers starting
together never read half a file; a write that fails leaves no temporary file behind; and a folder
that cannot be read or written only means the check runs again at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class KeptJson:
    """JSON objects by key (a file name without its suffix) in one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def get(self, key: str) -> dict[str, Any] | None:
        """The record kept for ``key``; None where there is none or it cannot be read."""
        try:
            data = json.loads((self.folder / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def put(self, key: str, record: dict[str, Any]) -> None:
        """Keep ``record`` for ``key`` (replacing what was kept), or log why it could not be."""
        tmp: str | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".json.partial")
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, self.folder / f"{key}.json")
        except OSError as exc:
            log.info("could not keep %s in %s: %s", key, self.folder, exc)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
