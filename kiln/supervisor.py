"""``kiln serve``: one gateway and N workers as child processes.

- Start: a gateway that exits by itself before it has ever answered ``/health`` (its port is
  taken, a bad setting), or a worker that exits before any worker has registered (a model that cannot load), is
  fatal: ``kiln serve`` stops the others and exits non-zero, the child's own error being already on
  stderr, instead of restarting it forever. The supervisor polls the gateway's ``/health`` until
  every worker has registered once.
- Console: the workers report their start-up (model load, native build) as JSON lines on a pipe
  (``--progress-fd``, protocol/logs.py ``progress_to``), which the supervisor prints as human
  lines on stdout; it prints the ready line once ``/health`` says ``ready`` (every model the
  server starts with has a worker registered, so a request would be served), not before.
- Running: a worker that exits is restarted, backing off when it dies soon after starting; a
  gateway that exits is restarted too (the workers re-register with it), with a backoff and at most
  ``GATEWAY_RESTARTS`` restarts in ``GATEWAY_WINDOW_S``, after which ``kiln serve`` gives up.
- On-demand models (``load = "on-demand"`` in the config): their workers start only when the
  gateway asks (``StartModel`` on the control channel, kiln/control.py), are restarted like the
  others while wanted (each exit reported as ``ModelExited``), and are stopped on ``StopModel``:
  SIGTERM, SIGKILL after the grace period, then ``ModelStopped`` once every process is gone.
- Stop: on SIGINT/SIGTERM the children's process groups get SIGTERM, then SIGKILL for any child
  that outlives the grace period. Each child runs in its own process group (a terminal's Ctrl-C
  reaches the supervisor alone, which stops them in order) and, on Linux, asks the kernel for
  SIGTERM when the supervisor dies (``PR_SET_PDEATHSIG``), so that even a SIGKILLed ``kiln serve``
  leaves no gateway or worker holding its ports.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.protocol.control import ControlMessage, ModelExited, ModelStopped, StartModel, StopModel

from .control import ControlEnd

log = logging.getLogger("kiln.supervisor")

GATEWAY_RESTARTS = 5
GATEWAY_WINDOW_S = 300.0
_PR_SET_PDEATHSIG = 1
# Loopback health probes must not go through an HTTP(S)_PROXY from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # looked up here, not in the forked child


def _child_setup(parent: int) -> Callable[[], None]:
    """The ``preexec_fn`` of every child: own process group, and die with the supervisor."""

    def setup() -> None:
        os.setpgid(0, 0)
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the supervisor died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None  # None: this process's environment
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    pass_fds: tuple[int, ...] = ()  # kept open in the child at every start

    def start(self, extra: list[str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        argv = [*self.argv, *(extra or [])]
        fds = (*self.pass_fds, *pass_fds)
        self.process = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, pass_fds=fds, preexec_fn=_child_setup(os.getpid()))
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart_when_due(self, now: float) -> bool:
        """Restart an exited worker with back-off. The first call after it exits schedules the
        restart and returns True (the exit is news); a call at or past that time starts it again.
        The back-off is longer when it died soon after starting (e.g. a model that won't load)."""
        if self.next_start == 0.0:
            quick = now - self.started_at < 30
            delay = min(30.0, 0.5 * (2 ** min(self.restarts, 6))) if quick else 0.5
            self.next_start = now + delay
            log.warning("worker exited; restarting", extra={"worker": self.name, "code": self.code, "in_s": delay})
            return True
        if now >= self.next_start:
            self.restarts += 1
            self.next_start = 0.0
            self.start()
        return False

    @property
    def code(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def signal_group(self, sig: int) -> None:
        """Signal the child's process group (the child and anything it started)."""
        if self.process is None or self.process.returncode is not None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.process.send_signal(sig)
            except ProcessLookupError:
                pass


def _print(line: str) -> None:
    print(line, flush=True)


def _exit_status(code: int | None) -> int:
    """A non-zero status for ``kiln serve`` from a child's return code (negative: a signal)."""
    if code is None or code == 0:
        return 1
    return code if code > 0 else 128 - code


@dataclass
class OnDemandGroup:
    """The workers of one on-demand model: started when the gateway asks, stopped when it says."""

    model: str
    workers: list[Child]
    wanted: bool = False
    stopping: bool = False
    kill_at: float = 0.0  # while stopping: when the survivors get SIGKILL


@dataclass
class Supervisor:
    gateway: Child
    workers: list[Child] = field(default_factory=list)  # always running
    grace_s: float = 10.0
    health_url: str | None = None
    on_demand: dict[str, OnDemandGroup] = field(default_factory=dict)
    control: ControlEnd | None = None  # to the gateway, when there are on-demand models
    ready_line: str | None = None  # what to try, printed after "ready" once the gateway says so
    say: Callable[[str], None] = field(default_factory=lambda: _print)  # the console (stdout)
    _progress: int | None = None  # read end of the workers' progress pipe
    _progress_write: int | None = None  # its write end, kept open: restarted workers get it too
    _partial: bytes = b""
    _announced: bool = False  # the ready line is out
    _started: float = 0.0
    _stopping: bool = False
    _ready: bool = False  # every worker has registered once
    _gateway_up: bool = False  # the gateway has answered /health once
    _seen: set[str] = field(default_factory=set)  # worker ids seen registered during the start
    _next_probe: float = 0.0
    _gateway_restarts: deque[float] = field(default_factory=deque)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._request_stop)
        self._started = time.monotonic()
        self._open_progress()
        self._start_gateway()
        for worker in self.workers:
            worker.start()
        try:
            while not self._stopping:
                code = self._tend_gateway()
                if code is None:
                    code = self._tend_workers()
                if code is not None:
                    return code
                self._tend_on_demand()
                if not (self._ready and self._announced):
                    self._probe()
                self._wait(0.2)
        finally:
            self._stop_all()
            if self.control is not None:
                self.control.close()
            for fd in (self._progress, self._progress_write):
                if fd is not None:
                    os.close(fd)
        return 0

    def _open_progress(self) -> None:
        """One pipe for every worker's start-up lines (each line is written whole)."""
        children = [*self.workers, *(w for g in self.on_demand.values() for w in g.workers)]
        if not children:
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        self._progress = read
        for child in children:
            child.argv = [*child.argv, "--progress-fd", str(write)]
            child.pass_fds = (write,)
        self._progress_write = write

    def _read_progress(self) -> None:
        """Print each worker's start-up line as ``kiln: worker-0: <message>``."""
        assert self._progress is not None
        try:
            data = os.read(self._progress, 65536)
        except (BlockingIOError, InterruptedError):
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-65536:]
        names = {c.process.pid: c.name for c in [*self.workers, *(w for g in self.on_demand.values() for w in g.workers)] if c.process is not None}
        for line in lines:
            try:
                record = json.loads(line)
                self.say(f"kiln: {names.get(record.get('pid'), 'worker')}: {record['msg']}")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue

    def _start_gateway(self) -> None:
        """Start the gateway, with a fresh control channel when there are on-demand models."""
        if not self.on_demand:
            self.gateway.start()
            return
        if self.control is not None:
            self.control.close()
        self.control = ControlEnd()
        fd = self.control.child_fd
        self.gateway.start(["--supervisor-fd", str(fd)], pass_fds=(fd,))
        self.control.child_started()

    def _wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking for the gateway's control messages and the workers'
        progress lines, and handling them."""
        sources: list[Any] = [s for s in (self.control, self._progress) if s is not None]
        if not sources:
            time.sleep(seconds)
            return
        try:
            readable, _, _ = select.select(sources, [], [], seconds)
        except (OSError, ValueError):  # closed under us
            time.sleep(seconds)
            return
        if self._progress is not None and self._progress in readable:
            self._read_progress()
        if self.control is not None and self.control in readable:
            for message in self.control.receive():
                self._on_message(message)

    def _on_message(self, message: ControlMessage) -> None:
        group = self.on_demand.get(getattr(message, "model", ""))
        if group is None:
            log.warning("the gateway asked about a model that is not on-demand", extra={"model": getattr(message, "model", None)})
            return
        if isinstance(message, StartModel):
            group.wanted, group.stopping = True, False
            for worker in group.workers:
                worker.restarts, worker.next_start = 0, 0.0
                if not worker.alive():  # one still exiting from a stop is restarted once it is gone
                    worker.start()
            log.info("started on-demand model", extra={"model": group.model})
        elif isinstance(message, StopModel):
            group.wanted, group.stopping = False, True
            group.kill_at = time.monotonic() + self.grace_s
            for worker in group.workers:
                worker.next_start = 0.0
                worker.signal_group(signal.SIGTERM)
            log.info("stopping on-demand model", extra={"model": group.model})

    def _tend_on_demand(self) -> None:
        now = time.monotonic()
        for group in self.on_demand.values():
            if group.stopping:
                alive = [w for w in group.workers if w.alive()]
                if not alive:
                    group.stopping = False
                    self._tell(ModelStopped(group.model))
                elif now >= group.kill_at:
                    for worker in alive:
                        worker.signal_group(signal.SIGKILL)
                continue
            if not group.wanted:
                continue
            for worker in group.workers:
                if worker.process is None or worker.alive():
                    continue
                if worker.restart_when_due(now):
                    self._tell(ModelExited(group.model, worker.code if worker.code is not None else -1))

    def _tell(self, message: ControlMessage) -> None:
        if self.control is not None:
            self.control.send(message)

    def _probe(self, *, now: bool = False) -> None:
        """Ask the gateway which workers have registered; the start is over once all have."""
        when = time.monotonic()
        if self.health_url is None or (when < self._next_probe and not now):
            return
        self._next_probe = when + 0.5
        try:
            with _OPENER.open(self.health_url, timeout=2) as r:
                body = r.read()
        except urllib.error.HTTPError as err:  # 503 until a worker registers; the body still says
            body = err.read()
        except (OSError, ValueError):
            return
        self._gateway_up = True
        try:
            health = json.loads(body)
            ids = {w["tag"] for w in health.get("workers") or []}
        except (ValueError, AttributeError, KeyError, TypeError):
            return
        self._seen |= ids
        if not self._ready and len(self._seen) >= len(self.workers):
            self._ready = True
            log.info("started", extra={"workers": len(self._seen)})
        if not self._announced and health.get("ready") is True:
            self._announced = True
            if self.ready_line is not None:
                self.say(f"kiln: ready in {time.monotonic() - self._started:.0f} s — {self.ready_line}")

    def _tend_gateway(self) -> int | None:
        gateway = self.gateway
        if gateway.alive():
            return None
        now = time.monotonic()
        if not self._gateway_up and (gateway.code or 0) >= 0:
            # It exited by itself before ever answering (port taken, bad settings): restarting
            # would fail the same way. One killed by a signal is restarted like any other.
            log.error("gateway exited during start; stopping", extra={"code": gateway.code})
            return _exit_status(gateway.code)
        if gateway.next_start == 0.0:
            window = self._gateway_restarts
            while window and now - window[0] > GATEWAY_WINDOW_S:
                window.popleft()
            if len(window) >= GATEWAY_RESTARTS:
                log.error(
                    "gateway keeps exiting; giving up",
                    extra={"code": gateway.code, "restarts": len(window), "window_s": GATEWAY_WINDOW_S},
                )
                return _exit_status(gateway.code)
            delay = min(10.0, 0.5 * (2 ** len(window)))
            gateway.next_start = now + delay
            log.warning("gateway exited; restarting", extra={"code": gateway.code, "in_s": delay})
        elif now >= gateway.next_start:
            self._gateway_restarts.append(now)
            gateway.restarts += 1
            gateway.next_start = 0.0
            self._start_gateway()
        return None

    def _tend_workers(self) -> int | None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.alive():
                continue
            if not self._ready and worker.restarts == 0 and not self._registered_any():
                # Exited before any worker registered: a model that cannot load fails now.
                log.error("worker exited during start; stopping", extra={"worker": worker.name, "code": worker.code})
                return _exit_status(worker.code)
            worker.restart_when_due(now)
        return None

    def _registered_any(self) -> bool:
        """Whether some worker has registered (asked again now: a worker that registered and died
        at once is still listed until its heartbeat times out)."""
        self._probe(now=True)
        return bool(self._seen)

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _stop_all(self) -> None:
        on_demand = [w for g in self.on_demand.values() for w in g.workers]
        children = [(c, c.process) for c in [*self.workers, *on_demand, self.gateway] if c.process is not None]
        for child, _ in children:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child, process in children:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
                process.wait()


def health_url(host: str, port: int) -> str:
    """Where the supervisor asks the gateway whether the workers have registered."""
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/health"


def build(*, gateway_args: list[str], gateway_env: dict[str, str] | None = None, workers: list[tuple[str, list[str]]],
          worker_env: dict[str, str] | None = None, health_url: str,
          on_demand: dict[str, list[tuple[str, list[str]]]] | None = None, ready_line: str | None = None) -> Supervisor:  # fmt: skip
    """The supervisor of one gateway and its workers, each given as (name, kiln-worker argv);
    `on_demand`: model id -> its workers, started only when the gateway asks; `ready_line`: what
    the console says to try once the gateway is ready."""
    python = sys.executable
    gateway = Child("gateway", [python, "-m", "kiln.gateway", *gateway_args], gateway_env)
    children = [Child(name, [python, "-m", "kiln.worker", *argv], worker_env) for name, argv in workers]
    groups = {
        model: OnDemandGroup(model, [Child(name, [python, "-m", "kiln.worker", *argv], worker_env) for name, argv in specs])
        for model, specs in (on_demand or {}).items()
    }
    return Supervisor(gateway, children, health_url=health_url, on_demand=groups, ready_line=ready_line)
