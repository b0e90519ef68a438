"""A fake upstream engine, named as such: a loopback HTTP server that replays recorded exchanges.

It answers ``/health`` and the completion path with the recorded server-sent events, keeps each
request body it was sent, and notices when a client closes a stream before the end (what an
engine sees when a request is cancelled). The recordings are in tests/data/upstream/<kind>.json,
each citing the engine source it was written from.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RECORDINGS = Path(__file__).parent.parent / "data" / "upstream"


def recording(kind: str) -> dict[str, Any]:
    return json.loads((RECORDINGS / f"{kind}.json").read_text())


class FakeEngine:
    def __init__(self, path: str, events: list[dict], *, done: bool, delay_s: float = 0.0, repeat: int = 1) -> None:
        self.path, self.events, self.done, self.delay_s, self.repeat = path, events, done, delay_s, repeat
        self.bodies: list[dict] = []
        self.authorizations: list[str | None] = []  # each completion request's Authorization header
        self.aborted = threading.Event()
        self.healthy = True
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                status = 200 if self.path == "/health" and fake.healthy else 503
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                fake.authorizations.append(self.headers.get("Authorization"))
                if self.path != fake.path:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                events = fake.events[:-1] * fake.repeat + fake.events[-1:] if fake.repeat > 1 else fake.events
                try:
                    for event in events:
                        time.sleep(fake.delay_s)
                        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                        self.wfile.flush()
                    if fake.done:
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    fake.aborted.set()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
