"""Start and stop the servers under test, each on the same weights.

Peers:
  kiln           `kiln serve` (one gateway + one worker) on the bundled GGUF (float32 on the CPU)
  kiln_scripted  `kiln serve --engine scripted`: no model; gateway + protocol + fake token stream
  mlx_lm_f32     `python -m mlx_lm.server` on the GGUF dequantized to float32, OpenBLAS preloaded
  mlx_lm_q4      `python -m mlx_lm.server` on the GGUF's own 4-bit weights, stock (no preload)
  llama_cpp      llama.cpp's `llama-server` on the GGUF itself: the one on PATH, else built here from
                 the llama-cpp-python sdist's sources for this CPU (bench/llama_cpp.py, cached)
  kiln_chat, kiln_scripted_chat
                 the same Kiln servers measured through /v1/chat/completions instead of
                 /v1/responses (what the Chat door adds; the same client as the chat peers)

Each server runs in its own session (process group) so that stopping it stops its children.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PEERS = ("kiln", "mlx_lm_f32", "mlx_lm_q4", "llama_cpp")
ALL_PEERS = (*PEERS, "kiln_scripted", "kiln_chat", "kiln_scripted_chat")


# llama-server's slots (requests decoded together; as many as the largest concurrent workload)
# and each slot's context: -c is divided among the slots, and the longest workload prompt (the
# ~1000-token shared system prompt plus its output) must fit in one.
LLAMA_SLOTS = 8
# How often a starting server's health is asked: load.ready_s is that fine, for every peer alike
# (at 0.5 s, a 1 s start read as 1.0-1.5 s).
READY_POLL_S = 0.05
LLAMA_SLOT_CONTEXT = 2048


@dataclass(frozen=True)
class ModelFile:
    """A GGUF every peer that can serves instead of the bundled model (`--model-shape`), under one id."""

    path: Path
    id: str


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (not installed); the harness skips it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """The cores this process may run on: the thread count Kiln's worker gives OpenMP and OpenBLAS."""
    from kiln.worker.loading import blas  # no mlx import: it runs before mlx loads

    return blas._usable_cores()


def _kiln_exe() -> list[str]:
    exe = Path(sys.executable).with_name("kiln")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kiln"]


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    api: str  # "responses" | "chat"
    model: str
    port: int
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    health: str = "/health"
    note: str = ""
    # Request fields that make this server generate exactly max_tokens (no early stop at EOS),
    # where it has such a field; workloads that compare rates send them.
    exact_length: dict[str, object] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def spec_for(name: str, *, scripted_delay: float = 0.01, scripted_reply: str | None = None, kiln_args: list[str] | None = None, blas_threads: int | None = None, threads: int | None = None,
    model: ModelFile | None = None, cpu: str = "native") -> ServerSpec:
    """The command line for peer `name`; raises PeerUnavailable if it cannot run here.

    `threads` sets every peer's compute threads: llama-server's `-t`, OMP_NUM_THREADS (Kiln's
    native kernels) and OPENBLAS_NUM_THREADS; each otherwise defaults to the usable core count.
    `blas_threads` sets OPENBLAS_NUM_THREADS alone, and wins over `threads` for it.
    `model`: the GGUF that `kiln` and `llama_cpp` serve (others cannot: PeerUnavailable), with
    Kiln's context at one llama-server slot's and speculation off (random weights make prompt
    lookup meaningless).
    `cpu`: "avx2" runs Kiln's AVX2 kernels (KILN_NATIVE_VARIANT) and OpenBLAS's
    (OPENBLAS_CORETYPE), and llama-server built without AVX-VNNI and AVX-512 (bench/llama_cpp.py),
    as a CPU without those extensions would.
    """
    if model is not None:
        if name not in ("kiln", "kiln_chat", "llama_cpp"):
            raise PeerUnavailable("serves only its own weights, not a --model-shape file")
        if name != "llama_cpp":
            kiln_args = [*(kiln_args or []), "--model", str(model.path), "--model-id", model.id, "--speculative", "off", "--context-length", str(LLAMA_SLOT_CONTEXT)]
    spec = _spec_for(name, scripted_delay=scripted_delay, scripted_reply=scripted_reply, kiln_args=kiln_args, threads=threads, model=model, cpu=cpu)
    if cpu != "native" and name.startswith("kiln"):
        # OpenBLAS (mlx's products where the native pass does not take them) picks its kernels
        # by the CPU at run time: Haswell's are its AVX2 ones.
        spec.env.update(KILN_NATIVE_VARIANT=cpu, OPENBLAS_CORETYPE="Haswell")
        spec.note += f", KILN_NATIVE_VARIANT={cpu}, OPENBLAS_CORETYPE=Haswell"
    if threads:
        spec.env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
        spec.note += f", OMP_NUM_THREADS=OPENBLAS_NUM_THREADS={threads}"
    if blas_threads:
        spec.env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
        spec.note += f", OPENBLAS_NUM_THREADS={blas_threads}"
    return spec


def _spec_for(name: str, *, scripted_delay: float, scripted_reply: str | None, kiln_args: list[str] | None, threads: int | None, model: ModelFile | None = None,
    cpu: str = "native") -> ServerSpec:
    if name in ("kiln_chat", "kiln_scripted_chat"):
        spec = _spec_for(name.removesuffix("_chat"), scripted_delay=scripted_delay, scripted_reply=scripted_reply, kiln_args=kiln_args, threads=threads, model=model, cpu=cpu)
        spec.name, spec.api, spec.note = name, "chat", spec.note + ", through /v1/chat/completions"
        return spec
    port = free_port()
    if name in ("kiln", "kiln_scripted"):
        argv = [*_kiln_exe(), "serve", "--port", str(port), "--workers-bind", f"tcp://127.0.0.1:{free_port()}", *(kiln_args or [])]
        env = dict(os.environ)
        if name == "kiln_scripted":
            argv += ["--engine", "scripted"]
            env["KILN_SCRIPTED_DELAY"] = str(scripted_delay)
            env["KILN_SCRIPTED_REPLY"] = scripted_reply if scripted_reply is not None else _long_reply()
            return ServerSpec(name, argv, "responses", "kiln-scripted", port, env, note=f"scripted engine, {scripted_delay * 1000:.0f} ms/token")
        if model is not None:
            return ServerSpec(name, argv, "responses", model.id, port, env, note=f"{model.path.name}, worker default weights, --speculative off, --context-length {LLAMA_SLOT_CONTEXT}")
        model_id = "smollm2-135m-instruct"
        if kiln_args and "--model" in kiln_args:
            model_id = Path(kiln_args[kiln_args.index("--model") + 1]).name
            return ServerSpec(name, argv, "responses", model_id, port, env, note=f"{model_id}, worker default weights")
        return ServerSpec(name, argv, "responses", model_id, port, env, note="bundled GGUF, worker default weights (on the CPU with the native kernels: the file's own blocks)")
    if name in ("mlx_lm_f32", "mlx_lm_q4"):
        if importlib.util.find_spec("mlx_lm") is None:
            raise PeerUnavailable("mlx-lm is not installed")
        from .convert import blas_env, convert

        variant = name.rsplit("_", 1)[1]
        folder = convert(variant)
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(folder), "--port", str(port), "--log-level", "WARNING"]
        env = dict(os.environ)
        note = f"{folder.name}"
        if variant == "f32":
            preload = blas_env(env)
            if preload is not None:
                env = preload
                note += f", LD_PRELOAD={Path(env['LD_PRELOAD'].split()[0]).name}"
            else:
                note += ", no OpenBLAS found (reference BLAS)"
        return ServerSpec(name, argv, "chat", "default_model", port, env, note=note)
    if name == "llama_cpp":
        from .convert import bundled_gguf
        from .llama_cpp import BuildError, server_binary

        try:
            binary = server_binary(cpu=cpu)
        except BuildError as exc:
            raise PeerUnavailable(str(exc)) from exc
        threads = threads or usable_cores()
        gguf, model_id = (model.path, model.id) if model is not None else (bundled_gguf(), "smollm2-135m-instruct")
        argv = [
            str(binary.path), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-np", str(LLAMA_SLOTS), "-c", str(LLAMA_SLOTS * LLAMA_SLOT_CONTEXT),
            "--jinja", "--alias", model_id,
        ]
        note = f"llama-server {binary.version}, {binary.origin}: {binary.path}; -t {threads}, -np {LLAMA_SLOTS}, {LLAMA_SLOT_CONTEXT} tokens per slot"
        # llama-server can promise the output length: without EOS its greedy text, computed with
        # 8-bit activations, could end at a different token than the mlx-based peers' does.
        return ServerSpec(name, argv, "chat", model_id, port, note=note, exact_length={"ignore_eos": True})
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(ALL_PEERS)}")


def _long_reply() -> str:
    # One byte a token in the scripted engine: enough for 64+ output tokens.
    return ("The quick brown fox jumps over the lazy dog. " * 8).strip()


class Server:
    """A running peer. Use as a context manager: started on enter, stopped on exit."""

    def __init__(self, spec: ServerSpec, *, log_dir: Path | None = None, ready_timeout: float = 600.0) -> None:
        self.spec = spec
        self.ready_timeout = ready_timeout
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kiln-bench-"))
        self.log_path = self.log_dir / f"{spec.name}-{spec.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.spec.argv, cwd=REPO, env=self.spec.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} while starting; log: {self.log_path}\n{self.tail()}")
            if self._healthy():
                return
            time.sleep(READY_POLL_S)
        self.stop()
        raise RuntimeError(f"{self.spec.name} not ready after {self.ready_timeout:.0f} s; log: {self.log_path}\n{self.tail()}")

    def _healthy(self) -> bool:
        try:
            r = httpx.get(self.spec.base_url + self.spec.health, timeout=2.0)
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        if self.spec.api == "responses":
            # Kiln's gateway answers before its worker has loaded and registered.
            try:
                workers = r.json().get("workers")
            except ValueError:
                return False
            return bool(workers)
        return True

    def model_process(self) -> int | None:
        """The pid holding the model: Kiln's worker (`python -m kiln.worker`, a child in the
        server's session), else the server process itself."""
        if self.proc is None:
            return None
        if self.spec.api == "responses" or self.spec.name.startswith("kiln"):
            for pid in session_pids(self.proc.pid):
                if b"kiln.worker" in _read(f"/proc/{pid}/cmdline"):
                    return pid
            return None
        return self.proc.pid

    def rss_mb(self) -> tuple[float | None, float | None]:
        """The model process's resident memory now and its peak (VmRSS, VmHWM), in MB (10^6 bytes)."""
        pid = self.model_process()
        return (None, None) if pid is None else memory_mb(pid)

    def tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace: float = 15.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # our own session: the server and its children
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the group (workers)
        except ProcessLookupError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (a server started with start_new_session), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _read(f"/proc/{entry.name}/stat")
            # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after ')'.
            fields = stat.rpartition(b")")[2].split()
            if len(fields) > 3 and int(fields[3]) == sid:
                out.append(int(entry.name))
    return sorted(out)


def memory_mb(pid: int) -> tuple[float | None, float | None]:
    """(VmRSS, VmHWM) of `pid` in MB, from /proc/<pid>/status; None where unreadable."""
    values: dict[str, float] = {}
    for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024 / 1e6  # kB
    return values.get("VmRSS"), values.get("VmHWM")
