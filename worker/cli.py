"""``kiln-worker``: load one model and serve it to one or more gateways over ZeroMQ."""

from __future__ import annotations

import logging
import platform
import signal
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from kiln.protocol import DEFAULT_WORKERS_ADDRESS
from kiln.protocol.logs import configure, progress_to
from kiln.protocol.settings_fields import from_options, settings_options

from .settings import WorkerSettings

if TYPE_CHECKING:  # the server module imports zmq; this one stays light for --help
    from .server import WorkerServer

log = logging.getLogger("kiln.worker")


def gateway_list(addresses: tuple[str, ...], *, discovering: bool = False) -> tuple[str, ...]:
    """The gateways to serve (``--gateway`` values, comma lists already split), in order, each
    once. None given: the default address, unless the gateways are discovered (then only those)."""
    unique = tuple(dict.fromkeys(addresses))
    if not unique and not discovering:
        return (DEFAULT_WORKERS_ADDRESS,)
    return unique


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@settings_options(WorkerSettings)
def main(**options: Any) -> None:
    """Serve one model to one or more kiln-gateways."""
    from kiln.protocol.security import SecretError, load_secret

    settings = from_config(from_options(WorkerSettings, options))
    try:  # checked before the model loads, which takes a while
        secret = load_secret(settings.worker_secret, settings.worker_secret_file)
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret") from exc
    gateways = gateway_list(settings.gateway, discovering=settings.discover_redis is not None)
    settings = replace(settings, gateway=gateways, worker_secret=secret, worker_secret_file=None)
    if settings.engine == "mlx":
        # Before mlx is imported: on Linux CPUs re-exec with OpenBLAS preloaded (see blas.py).
        from .loading.blas import reexec_with_openblas

        reexec_with_openblas(sys.argv)
        # Before the engine imports mlx_lm: its package __init__ imports transformers, which
        # the GGUF path never uses (~1-1.5 s of a start; see mlx_lm_import.py).
        from .loading.mlx_lm_import import defer_package_init

        defer_package_init()
    configure(settings.log_level)
    from .loading.errors import ModelNotFoundError, UnsupportedModelError

    try:
        with progress_to(settings.progress_fd, "kiln.worker"):
            log.info("starting: Python %s on %s %s; importing the engine", platform.python_version(), platform.system(), platform.machine())
            server = build_server(settings)
    except (ModelNotFoundError, UnsupportedModelError) as exc:
        # The user named a model we cannot serve: say why in one line, no traceback.
        log.critical("cannot load model: %s", exc)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.service.scheduler.stop()


def from_config(settings: WorkerSettings) -> WorkerSettings:
    """With ``--config``, the settings of the model ``--model-id`` names in that file (its source,
    aliases, window, batch, caches and tool parser) over the rest, as ``kiln serve --config`` gives
    them to that model's workers: one file for every process of a deployment."""
    if settings.config_path is None:
        return settings
    from kiln.protocol.model_config import ConfigError, load_config

    if settings.model or settings.model_alias:
        raise click.UsageError("--config names the model's source and aliases: drop --model/--model-alias")
    if not settings.model_id:
        raise click.UsageError("--config needs --model-id: the id of the [[models]] entry this worker serves")
    try:
        model = load_config(settings.config_path).model(settings.model_id)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    return replace(settings, config_path=None, **model.worker_settings())


_LAYOUTS = {"auto": None, "stock": False, "input-major": True}


def served_names(settings: WorkerSettings) -> tuple[str, list[str]]:
    """The model id and aliases this worker registers, known before it loads anything: its
    registration (build_server) and ``kiln serve``, which tells the gateway beforehand, both ask
    here."""
    if settings.engine == "scripted":
        return settings.model_id or "kiln-scripted", list(settings.model_alias)
    from .loading.loader import model_names

    own, aliases = model_names(settings.model)
    model_id = settings.model_id or own
    return model_id, sorted(set(aliases) | set(settings.model_alias) | {own, model_id})


def build_server(settings: WorkerSettings) -> WorkerServer:
    from .capabilities import describe
    from .server import WorkerServer
    from .service import GenerationService, ServiceConfig
    from .setup import Constraints, model_extras

    ready = None  # the MLX and scripted engines are ready once built
    # Each engine brings its own tokenizer, scheduler and constraints, with the same methods:
    # GenerationService and model_extras take any of them (duck-typed, as Any there too).
    tokenizer: Any
    scheduler: Any
    constraints: Any
    memory: dict[str, int] = {}  # what the loaded model's memory is (mlx engine only)
    if settings.engine == "scripted":
        from .scripted import ByteTokenizer, ScriptedScheduler

        time.sleep(settings.scripted_load_delay)  # a slow load, for tests of bounded waits
        tokenizer = ByteTokenizer()
        scheduler = ScriptedScheduler(settings.scripted_reply, delay_s=settings.scripted_delay, capacity=settings.max_batch, queue_depth=settings.queue_depth)
        model_id, aliases = served_names(settings)
        window = settings.context_length or 8192
        constraints = Constraints(tokenizer)
    elif settings.engine == "upstream":
        from .upstream.setup import build_upstream

        try:
            upstream = build_upstream(settings)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        tokenizer, scheduler, constraints = upstream.tokenizer, upstream.scheduler, upstream.constraints
        model_id, aliases, window = upstream.model_id, upstream.aliases, upstream.context_window
        ready = lambda: upstream.scheduler.healthy  # noqa: E731
    else:
        from .engine.native_verdict import CheckSource
        from .engine.scheduler import Scheduler, kv_cache_refusal
        from .engine.speculative import Speculation
        from .loading.loader import load_model
        from .loading.progress import LoadProgress

        refused = kv_cache_refusal(settings.kv_cache, settings.max_batch)
        if refused:  # before the load, which takes a while
            raise click.BadParameter(refused, param_hint="--max-batch")
        started = time.monotonic()
        progress = LoadProgress(settings.model or "the bundled model")
        # The grammar compiler (a second of CPU) builds in the background from the moment the
        # tokenizer exists, beside the weights' load rather than after it: registration waits for it.
        early: list[Constraints] = []
        with progress.step("reading and converting the weights"):
            loaded = load_model(settings.model, weights=settings.weights, on_tokenizer=lambda t: early.append(Constraints(t)))
        log.info("model loaded", extra={"model": loaded.model_id, "seconds": round(time.monotonic() - started, 2)})
        tokenizer = loaded.tokenizer
        constraints = early[0] if early else Constraints(tokenizer)
        check = CheckSource(loaded.source_path, settings.weights, settings.weight_layout)
        with progress.step("preparing the engine"):  # on the CPU: measures both weight layouts
            scheduler = Scheduler(loaded.model, max_batch=settings.max_batch, queue_depth=settings.queue_depth, prefill_chunk=settings.prefill_chunk, cache_bytes=settings.cache_bytes,
                input_major_weights=_LAYOUTS[settings.weight_layout], speculation=Speculation(settings.speculative, settings.speculative_tokens), check_source=check,
                kv_cache=settings.kv_cache)
        model_id, aliases = served_names(settings)
        window = loaded.context_window
        if settings.context_length:
            window = min(window, settings.context_length)
    extras = model_extras(tokenizer, settings.tool_parser, constraints)
    scheduler.start()
    if settings.engine == "mlx":
        scheduler.wait_set_up()  # register only once a request would be served at once
        log.info("engine ready")
        from .memory_report import log_memory, memory_report

        memory = memory_report(loaded.model, window, kv_int8=scheduler.kv_int8)
        log_memory(model_id, memory)
    config = ServiceConfig(model_id=model_id, context_window=window, default_max_output_tokens=settings.max_output_tokens)
    service = GenerationService(tokenizer=tokenizer, scheduler=scheduler, config=config, **extras)
    discovery = None
    if settings.discover_redis:
        from .discovery import RedisDiscovery

        discovery = RedisDiscovery(settings.discover_redis, settings.redis_namespace)
    features = describe(tokenizer, settings.tool_parser, constraints, settings.max_output_tokens).to_map()
    return WorkerServer(list(settings.gateway), service, model_id=model_id, aliases=aliases, context_window=window, capacity=settings.max_batch, queue_depth=settings.queue_depth,
        features=features, secret=settings.worker_secret, discovery=discovery, ready=ready, memory=memory)
