"""The gateway's end of the control channel to ``kiln serve``'s supervisor (protocol/control.py).

``kiln serve`` hands the gateway one end of a Unix socket pair as ``--supervisor-fd``; the
on-demand loader (ondemand.py) sends ``StartModel``/``StopModel`` on it and hears back
``ModelExited``/``ModelStopped``. A gateway started on its own (systemd) has no link: it lists
on-demand models but cannot start them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import Callable

from kiln.protocol.control import MAX_LINE, ControlError, ControlMessage, decode_line, encode_line

from ..lifecycle.tasks import stop_tasks

log = logging.getLogger("kiln.gateway.pool.supervisor_link")

# Lines waiting to be written beyond this mean the supervisor has stopped reading: drop, and say so.
MAX_PENDING_BYTES = 1 << 20


def check_fd(fd: int) -> str | None:
    """Why ``fd`` cannot be the control socket, or None."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return f"file descriptor {fd} is not open"
    return None if stat.S_ISSOCK(mode) else f"file descriptor {fd} is not a socket"


class SupervisorLink:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, on_message: Callable[[ControlMessage], None]) -> None:
        sock = socket.socket(fileno=self.fd)
        reader, self._writer = await asyncio.open_unix_connection(sock=sock, limit=2 * MAX_LINE)
        self._task = asyncio.create_task(self._read(reader, on_message), name="kiln-supervisor-link")

    async def stop(self) -> None:
        await stop_tasks([self._task])
        if self._writer is not None:
            self._writer.close()

    def send(self, message: ControlMessage) -> None:
        writer = self._writer
        if writer is None or writer.is_closing():
            log.warning("control channel closed: dropped %s", type(message).__name__)
            return
        if writer.transport.get_write_buffer_size() > MAX_PENDING_BYTES:
            log.warning("the supervisor is not reading the control channel: dropped %s", type(message).__name__)
            return
        writer.write(encode_line(message))

    async def _read(self, reader: asyncio.StreamReader, on_message: Callable[[ControlMessage], None]) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, ConnectionError) as exc:  # a line over the limit, a reset
                log.warning("control channel unreadable: %s", exc)
                return
            if not line:
                log.warning("the supervisor closed the control channel")
                return
            try:
                message = decode_line(line)
            except ControlError as exc:
                log.warning("dropped a control line: %s", exc)
                continue
            try:
                on_message(message)
            except Exception:  # one bad message must not end the link
                log.exception("error handling %s", type(message).__name__)
