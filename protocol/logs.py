"""Structured, quiet-by-default logging for all Kiln processes.

Each record is one JSON line on stderr: time, level, logger, message and any ``extra`` fields.
The default level is WARNING, so a healthy server prints next to nothing (client 4xx errors are
not logged at all); ``--log-level info`` shows model loads, worker registrations and requests.

Everything that would print to stderr goes through the one JSON handler: Hypercorn's error log
(the gateway hands Hypercorn the ``hypercorn.error`` logger instead of letting it add its own
plain-text handler, which printed each traceback a second time), ``warnings``, and uncaught
exceptions in the main thread and in other threads.

A traceback is logged once, inside its JSON line (``exc``), and bounded in size. The same failure
repeating (same exception type raised at the same place) within ``REPEAT_WINDOW_S`` is logged
without its traceback (``exc_type`` and ``exc_repeats`` instead), so a client that can trigger a
server error cannot fill the disk with copies of one traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

from .settings_fields import setting

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

MAX_MESSAGE_CHARS = 4096
MAX_TRACEBACK_CHARS = 16384
REPEAT_WINDOW_S = 60.0
_REPEAT_KEYS = 256  # distinct failures remembered for the repeat window

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]

LogLevel = Literal["debug", "info", "warning", "error"]


def log_level_setting() -> Any:
    """The ``--log-level`` field every Kiln command declares (one default, one help)."""
    return setting("warning", help="Log level; warning keeps a healthy server quiet.")


def _clip(text: str, limit: int) -> str:
    """Keep the head and the tail (where a traceback names the exception) of an over-long text."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


def _failure_key(exc_info: ExcInfo) -> tuple[str, str, int]:
    """Where the exception was raised: its type and the innermost frame."""
    kind, _value, tb = exc_info
    filename, lineno = "", 0
    while tb is not None:
        filename, lineno = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next
    return (getattr(kind, "__qualname__", str(kind)), filename, lineno)


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        # failure key -> (when its traceback was last written, repeats logged since)
        self._recent: dict[tuple[str, str, int], tuple[float, int]] = {}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _clip(record.getMessage(), MAX_MESSAGE_CHARS),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            entry.update(self._exception(record.exc_info, record.created))
        elif record.exc_text:
            entry["exc"] = _clip(record.exc_text, MAX_TRACEBACK_CHARS)
        return json.dumps(entry, default=str)

    def _exception(self, exc_info: ExcInfo, now: float) -> dict[str, Any]:
        key = _failure_key(exc_info)
        with self._lock:
            seen = self._recent.pop(key, None)
            if seen is not None and now - seen[0] < REPEAT_WINDOW_S:
                self._recent[key] = (seen[0], seen[1] + 1)
                return {"exc_type": key[0], "exc_repeats": seen[1] + 1}
            self._recent[key] = (now, 0)
            while len(self._recent) > _REPEAT_KEYS:
                self._recent.pop(next(iter(self._recent)))
        return {"exc_type": key[0], "exc": _clip(self.formatException(exc_info), MAX_TRACEBACK_CHARS)}


def configure(level: str = "warning") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.setLevel(level.upper())  # so that a logger opened wider for progress_to() stays quiet here
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.Formatter.converter = time.gmtime
    logging.captureWarnings(True)  # warnings.warn() would print plain text to stderr
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("kiln").critical("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else None
    error = args.exc_value if args.exc_value is not None else args.exc_type()
    logging.getLogger("kiln").error("uncaught exception in a thread", exc_info=(args.exc_type, error, args.exc_traceback), extra={"thread": thread})


def warn_secret_on_command_line(flag: str, instead: str) -> None:
    """One warning line: a secret passed as a flag is readable by every local user via `ps`."""
    logging.getLogger("kiln.security").warning(
        f"{flag} on the command line is visible to every local user (ps, /proc); use {instead}",
        extra={"flag": flag},
    )


_PIPE_LINE = 4000  # bytes: under PIPE_BUF (4096 on Linux, 512 by POSIX), a write is whole


class _PipeHandler(logging.Handler):
    """One JSON line per record on a pipe (a line under PIPE_BUF is written whole, so the lines
    of several processes sharing the pipe never mix); a reader that is gone or full is ignored."""

    def __init__(self, fd: int) -> None:
        super().__init__(logging.INFO)
        self.fd = fd
        self.setFormatter(JsonFormatter())
        with contextlib.suppress(OSError):
            os.set_blocking(fd, False)  # a reader that stopped reading drops lines, never stalls the start

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry = json.loads(self.format(record))
            entry["pid"] = record.process
            line = json.dumps(entry, default=str)
            if len(line.encode()) > _PIPE_LINE:  # over PIPE_BUF it could be split: keep what says what happened
                line = json.dumps({k: entry[k] for k in ("ts", "level", "logger", "pid")} | {"msg": entry["msg"][:1000]})
            os.write(self.fd, (line + "\n").encode())
        except (OSError, ValueError):
            pass


@contextlib.contextmanager
def progress_to(fd: int | None, logger: str) -> Iterator[None]:
    """While the block runs, the info records of ``logger`` (and its children) also go to ``fd``
    as JSON lines, whatever the log level: ``kiln serve`` shows a worker's start-up on its
    console from them (model load, native build) while stderr stays as quiet as configured."""
    if fd is None:
        yield
        return
    target = logging.getLogger(logger)
    handler = _PipeHandler(fd)
    level = target.level
    target.setLevel(min(logging.INFO, target.getEffectiveLevel()))
    target.addHandler(handler)
    try:
        yield
    finally:
        target.removeHandler(handler)
        target.setLevel(level)
        with contextlib.suppress(OSError):
            os.close(fd)
