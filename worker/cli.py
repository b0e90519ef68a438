"""``kiln-worker``: load one model and serve it to one or more gateways over ZeroMQ."""

from __future__ import annotations

import logging
import signal
import sys
import time

import click

from kiln.protocol.logs import configure
from kiln.protocol import DEFAULT_WORKERS_ADDRESS

log = logging.getLogger("kiln.worker")


def gateway_list(values: tuple[str, ...] | list[str]) -> list[str]:
    """The gateways to serve: each value may hold several comma-separated addresses (so that
    ``KILN_GATEWAY=tcp://a:5555,tcp://b:5555`` works), in order, each once."""
    addresses = [part.strip() for value in values for part in value.split(",")]
    unique = list(dict.fromkeys(a for a in addresses if a))
    if not unique:
        raise click.BadParameter("give at least one gateway address", param_hint="--gateway")
    return unique


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--gateway", multiple=True, default=[DEFAULT_WORKERS_ADDRESS], show_default=True, envvar="KILN_GATEWAY", callback=lambda _ctx, _param, value: gateway_list(value), help="ZeroMQ address of a gateway's worker socket; repeat it (or separate addresses with commas) to serve several gateway replicas.")
@click.option("--model", default=None, envvar="KILN_MODEL", help="A GGUF file or an mlx-lm model folder. Default: the bundled SmolLM2-135M-Instruct.")
@click.option("--model-id", default=None, envvar="KILN_MODEL_ID", help="The id to serve the model under (default: from its file, folder or hub id).")
@click.option("--context-length", default=None, type=int, envvar="KILN_CONTEXT_LENGTH", help="Serve at most this many tokens of context (default: the model's trained window).")
@click.option("--model-alias", multiple=True, envvar="KILN_MODEL_ALIAS", help="Another name clients may use for the model (repeatable).")
@click.option("--weights", type=click.Choice(["auto", "native", "float32", "float16", "bfloat16"]), default="auto", show_default=True, envvar="KILN_WEIGHTS", help="Weight layout. auto: dequantized on the CPU, the model's own quantization on Metal/CUDA.")
@click.option("--weight-layout", type=click.Choice(["auto", "stock", "input-major"]), default="auto", show_default=True, envvar="KILN_WEIGHT_LAYOUT", help="CPU only: how dense weights are stored for matmuls. auto measures both at start-up and keeps the faster.")
@click.option("--max-batch", default=8, show_default=True, type=int, envvar="KILN_MAX_BATCH", help="Requests decoded together.")
@click.option("--queue-depth", default=64, show_default=True, type=int, envvar="KILN_QUEUE_DEPTH", help="Requests that may wait for a batch slot; more get 503.")
@click.option("--prefill-chunk", default=512, show_default=True, type=int, envvar="KILN_PREFILL_CHUNK", help="Prompt tokens processed per scheduler step.")
@click.option("--cache-bytes", default=1 << 30, show_default=True, type=int, envvar="KILN_CACHE_BYTES", help="Byte budget of the prefix (prompt) cache; 0 turns it off.")
@click.option("--tool-parser", default=None, envvar="KILN_TOOL_PARSER", help="Tool-call format (hermes, mistral, llama3, qwen3_coder, pythonic, ...). Default: chosen from the chat template.")
@click.option("--max-output-tokens", default=4096, show_default=True, type=int, envvar="KILN_MAX_OUTPUT_TOKENS", help="Output cap when a request sets none.")
@click.option("--engine", type=click.Choice(["mlx", "scripted"]), default="mlx", show_default=True, envvar="KILN_ENGINE", help="scripted: a weightless engine for protocol tests and overhead benchmarks.")
@click.option("--scripted-reply", default="Hello from Kiln's scripted engine.", envvar="KILN_SCRIPTED_REPLY", help="Reply text of the scripted engine.")
@click.option("--scripted-delay", default=0.0, type=float, envvar="KILN_SCRIPTED_DELAY", help="Seconds per token of the scripted engine.")
@click.option("--log-level", default="warning", show_default=True, envvar="KILN_LOG_LEVEL", help="debug, info, warning or error.")
@click.option("--worker-secret", default=None, envvar="KILN_WORKER_SECRET", help="The gateway's worker secret (ZeroMQ CURVE); without the right one the gateway never sees this worker.")
@click.option("--worker-secret-file", default=None, type=click.Path(dir_okay=False), envvar="KILN_WORKER_SECRET_FILE", help="Read --worker-secret from this file, so it never shows in `ps`.")
def main(**options) -> None:
    """Serve one model to one or more kiln-gateways."""
    from kiln.protocol.security import SecretError, load_secret

    try:  # checked before the model loads, which takes a while
        options["worker_secret"] = load_secret(options["worker_secret"], options.pop("worker_secret_file"))
    except SecretError as exc:
        raise click.BadParameter(str(exc), param_hint="--worker-secret")
    if options["engine"] == "mlx":
        # Before mlx is imported: on Linux CPUs re-exec with OpenBLAS preloaded (see blas.py).
        from .loading.blas import reexec_with_openblas

        reexec_with_openblas(sys.argv)
    configure(options["log_level"])
    from .loading import ModelNotFoundError, UnsupportedModelError

    try:
        server = build_server(options)
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


def build_server(options: dict):
    from .server import WorkerServer
    from .service import GenerationService, ServiceConfig

    if options["engine"] == "scripted":
        from .scripted import ByteTokenizer, ScriptedScheduler

        tokenizer = ByteTokenizer()
        scheduler = ScriptedScheduler(options["scripted_reply"], delay_s=options["scripted_delay"], capacity=options["max_batch"], queue_depth=options["queue_depth"])
        from .setup import model_extras

        model_id, aliases, window = "kiln-scripted", list(options["model_alias"]), 8192
        extras = model_extras(tokenizer, options)
    else:
        from .engine.scheduler import Scheduler
        from .loading import load_model
        from .setup import model_extras

        started = time.monotonic()
        loaded = load_model(options["model"], weights=options["weights"])
        log.info("model loaded", extra={"model": loaded.model_id, "seconds": round(time.monotonic() - started, 2)})
        tokenizer = loaded.tokenizer
        scheduler = Scheduler(loaded.model, max_batch=options["max_batch"], queue_depth=options["queue_depth"], prefill_chunk=options["prefill_chunk"], cache_bytes=options["cache_bytes"], input_major_weights=_LAYOUTS[options["weight_layout"]])
        model_id = options.get("model_id") or loaded.model_id
        aliases = sorted(set(loaded.aliases) | set(options["model_alias"]) | {loaded.model_id, model_id})
        window = loaded.context_window
        if options.get("context_length"):
            window = min(window, options["context_length"])
        extras = model_extras(tokenizer, options)
    scheduler.start()
    config = ServiceConfig(model_id=model_id, context_window=window, default_max_output_tokens=options["max_output_tokens"])
    service = GenerationService(tokenizer=tokenizer, scheduler=scheduler, config=config, **extras)
    return WorkerServer(options["gateway"], service, model_id=model_id, aliases=aliases, context_window=window, capacity=options["max_batch"], queue_depth=options["queue_depth"], secret=options.get("worker_secret"))
