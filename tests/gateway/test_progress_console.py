"""kiln serve's console in process: a worker's start-up records reach the supervisor's pipe as
JSON lines whatever the log level (stderr stays quiet), and the supervisor prints them as
``kiln: worker-0: <message>`` lines."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading

from kiln.protocol.logs import configure, progress_to
from kiln.supervisor import Child, Supervisor


def test_start_up_records_reach_the_pipe_and_not_stderr(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # configure() replaces them: put back after
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    configure("warning")
    read, write = os.pipe()
    log = logging.getLogger("kiln.worker.loading")
    try:
        with progress_to(write, "kiln.worker"):
            log.info("loading model %s", "m", extra={"bytes": 7})
            log.info("x" * 10000)  # too long for one pipe write: cut to what says what happened
        log.info("after the start")  # the pipe is closed and the level back: nowhere
        data = os.read(read, 65536).decode()
    finally:
        os.close(read)
    lines = [json.loads(line) for line in data.splitlines()]
    assert lines[0]["msg"] == "loading model m" and lines[0]["bytes"] == 7 and lines[0]["pid"] == os.getpid()
    assert len(lines) == 2 and lines[1]["msg"] == "x" * 1000
    assert err.getvalue() == ""  # warning level: the info records never reached stderr
    assert logging.getLogger("kiln.worker").level == logging.NOTSET


def test_the_supervisor_prints_each_worker_line():
    said: list[str] = []
    worker = Child("worker-0", [sys.executable, "-c", ""])
    worker.process = subprocess.Popen(worker.argv)
    worker.process.wait()
    supervisor = Supervisor(Child("gateway", []), [worker], say=said.append)
    supervisor._open_progress()
    assert worker.argv[-2] == "--progress-fd" and worker.pass_fds
    try:
        record = {"msg": "loading model m from f (1.0 MB, weights=auto)", "pid": worker.process.pid}
        os.write(worker.pass_fds[0], (json.dumps(record) + "\nnot json\n" + json.dumps({"msg": "half"})[:5]).encode())
        supervisor._read_progress()
    finally:
        os.close(supervisor._progress)
        os.close(supervisor._progress_write)
    assert said == ["kiln: worker-0: loading model m from f (1.0 MB, weights=auto)"]
