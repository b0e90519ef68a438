"""Kiln's data directory: what ``kiln serve`` keeps across restarts on this machine.

Today that is one file, ``secret-key``: the key that seals reasoning handed to clients in
``encrypted_content`` (gateway/lifecycle/sealing.py). With a key that outlives the process, a client that
carries a reasoning item (Codex with ``store: false``) keeps working after ``kiln serve``
restarts. The file is created once, mode 0600 in a 0700 directory, and a key file that others
may read is refused rather than used. Hosted replicas do not use it: they share the key they are
given (``--secret-key`` / ``KILN_SECRET_KEY``), as before.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KEY_FILE = "secret-key"


class StateError(Exception):
    """The data directory or its key file cannot be used; the message says why and what to do."""


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/kiln``, else ``~/.local/share/kiln`` (the XDG base directory default)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "kiln"


def sealing_key(directory: Path) -> str:
    """The key in ``directory/secret-key``, made (0600, 32 random bytes as hex) when there is none.

    Made in a temporary file and linked into place, so that two servers starting at once end up
    with the same key, and a reader never sees a half-written one."""
    path = directory / KEY_FILE
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            tmp = directory / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, (secrets.token_hex(32) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another server made it first: use theirs
            finally:
                tmp.unlink()
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise StateError(f"{path} can be read by other users (mode {stat.S_IMODE(mode):o}): run chmod 600 {path}")
        key = path.read_text(encoding="ascii").strip()
    except OSError as exc:
        raise StateError(f"cannot use the data directory {directory}: {exc.strerror or exc} (set --data-dir or KILN_DATA_DIR)") from exc
    except UnicodeDecodeError:
        raise StateError(f"{path} is not a Kiln key file: remove it and a new key is made") from None
    if len(key) < 32:
        raise StateError(f"{path} holds no key: remove it and a new key is made")
    return key
