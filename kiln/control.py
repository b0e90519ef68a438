"""The supervisor's end of the control channel to its gateway (protocol/control.py).

One Unix socket pair per gateway process: the gateway inherits one end (``--supervisor-fd``),
the supervisor keeps the other, non-blocking, and reads it between its rounds of tending the
children. A restarted gateway gets a fresh pair; whatever the old one asked was already done.
"""

from __future__ import annotations

import logging
import socket

from kiln.protocol.control import MAX_LINE, ControlError, ControlMessage, decode_line, encode_line

log = logging.getLogger("kiln.supervisor.control")


class ControlEnd:
    def __init__(self) -> None:
        self._ours, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ours.setblocking(False)
        self._theirs.set_inheritable(True)
        self._buffer = b""

    @property
    def child_fd(self) -> int:
        """The descriptor the gateway inherits (the same number in the child: ``pass_fds``)."""
        return self._theirs.fileno()

    def fileno(self) -> int:
        return self._ours.fileno()

    def child_started(self) -> None:
        """The gateway holds its end now: ours must not keep it open (EOF must reach us)."""
        self._theirs.close()

    def close(self) -> None:
        for sock in (self._ours, self._theirs):
            sock.close()

    def receive(self) -> list[ControlMessage]:
        """The complete messages that have arrived (none when nothing has)."""
        try:
            data = self._ours.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return []
        if not data:
            return []
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE:
            log.warning("dropped an over-long control line from the gateway")
            self._buffer = b""
        messages = []
        for line in lines:
            try:
                messages.append(decode_line(line))
            except ControlError as exc:
                log.warning("dropped a control line from the gateway: %s", exc)
        return messages

    def send(self, message: ControlMessage) -> None:
        """Best effort: a gateway that is gone or not reading loses the report (a new gateway
        learns the state from the workers that register with it)."""
        line = encode_line(message)
        try:
            sent = self._ours.send(line)
        except OSError as exc:
            log.warning("could not tell the gateway %s: %s", type(message).__name__, exc)
            return
        if sent != len(line):  # a gateway that stopped reading: the stream cannot be resumed
            log.warning("the gateway is not reading the control channel; closing it")
            self._ours.close()
