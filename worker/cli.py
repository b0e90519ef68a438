"""``kiln-worker``: load one model and serve it to a gateway over ZeroMQ."""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import replace
from typing import Any

import click

from kiln.protocol.logs import configure
from kiln.protocol.settings_fields import from_options, settings_options

from .settings import WorkerSettings

log = logging.getLogger("kiln.worker")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@settings_options(WorkerSettings)
def main(**options: Any) -> None:
    """Serve one model to a kiln-gateway."""
    from kiln.protocol.security import SecretError, load_secret

    settings = from_options(WorkerSettings, options)
    try:  # checked before the model loads, which takes a while
        secret = load_secret(settings.worker_secret, settings.worker_secret_file)
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret")
    settings = replace(settings, worker_secret=secret, worker_secret_file=None)
    if settings.engine == "mlx":
        # Before mlx is imported: on Linux CPUs re-exec with OpenBLAS preloaded (see blas.py).
        from .loading.blas import reexec_with_openblas

        reexec_with_openblas(sys.argv)
    configure(settings.log_level)
    from .loading import ModelNotFoundError, UnsupportedModelError

    try:
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


_LAYOUTS = {"auto": None, "stock": False, "input-major": True}


def build_server(settings: WorkerSettings):
    from .server import WorkerServer
    from .service import GenerationService, ServiceConfig

    if settings.engine == "scripted":
        from .scripted import ByteTokenizer, ScriptedScheduler

        tokenizer = ByteTokenizer()
        scheduler = ScriptedScheduler(settings.scripted_reply, delay_s=settings.scripted_delay, capacity=settings.max_batch, queue_depth=settings.queue_depth)
        from .setup import model_extras

        model_id, aliases, window = "kiln-scripted", list(settings.model_alias), 8192
        extras = model_extras(tokenizer, settings.tool_parser)
    else:
        from .engine.scheduler import Scheduler
        from .loading import load_model
        from .setup import model_extras

        started = time.monotonic()
        loaded = load_model(settings.model, weights=settings.weights)
        log.info("model loaded", extra={"model": loaded.model_id, "seconds": round(time.monotonic() - started, 2)})
        tokenizer = loaded.tokenizer
        scheduler = Scheduler(loaded.model, max_batch=settings.max_batch, queue_depth=settings.queue_depth, prefill_chunk=settings.prefill_chunk, cache_bytes=settings.cache_bytes, input_major_weights=_LAYOUTS[settings.weight_layout])
        model_id = settings.model_id or loaded.model_id
        aliases = sorted(set(loaded.aliases) | set(settings.model_alias) | {loaded.model_id, model_id})
        window = loaded.context_window
        if settings.context_length:
            window = min(window, settings.context_length)
        extras = model_extras(tokenizer, settings.tool_parser)
    scheduler.start()
    config = ServiceConfig(model_id=model_id, context_window=window, default_max_output_tokens=settings.max_output_tokens)
    service = GenerationService(tokenizer=tokenizer, scheduler=scheduler, config=config, **extras)
    return WorkerServer(settings.gateway, service, model_id=model_id, aliases=aliases, context_window=window, capacity=settings.max_batch, queue_depth=settings.queue_depth, secret=settings.worker_secret)
