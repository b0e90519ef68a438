"""Structured, quiet-by-default logging for all Kiln processes.

Each record is one JSON line on stderr: time, level, logger, message and any ``extra`` fields.
The default level is WARNING, so a healthy server prints next to nothing; ``--log-level info``
shows model loads, worker registrations and requests.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "warning") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime


def warn_secret_on_command_line(flag: str, instead: str) -> None:
    """One warning line: a secret passed as a flag is readable by every local user via `ps`."""
    logging.getLogger("kiln.security").warning(
        f"{flag} on the command line is visible to every local user (ps, /proc); use {instead}",
        extra={"flag": flag},
    )
