"""Worker settings: one typed dataclass, the single source of ``kiln-worker``'s flags.

Each field is a flag of ``kiln-worker`` (and of ``kiln serve``, which forwards it) reading
``KILN_<FLAG>``; the click options are generated from it (``kiln.protocol.settings_fields``).
docs/configuration.md documents every flag; tests/test_settings_docs.py keeps it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.protocol import DEFAULT_WORKERS_ADDRESS
from kiln.protocol.discovery import DEFAULT_REDIS_NAMESPACE
from kiln.protocol.logs import LogLevel, log_level_setting
from kiln.protocol.model_config import KVCacheType
from kiln.protocol.settings_fields import setting


@dataclass(frozen=True)
class WorkerSettings:
    # Empty: DEFAULT_WORKERS_ADDRESS, unless the gateways are discovered (worker/cli.py).
    gateway: tuple[str, ...] = setting((), separator=",", repeatable=True,
        help=f"ZeroMQ address of a gateway's worker socket; repeat it (or separate addresses with commas) to serve several gateway replicas. Default: {DEFAULT_WORKERS_ADDRESS}, or none with "
            "--discover-redis.")
    discover_redis: str | None = setting(None, secret=True,
        help="Redis URL where gateway replicas advertise their worker addresses (their --advertise-workers): serve each one advertised, picking up replicas that appear or go.")
    redis_namespace: str = setting(DEFAULT_REDIS_NAMESPACE, help="Key prefix in Redis; replicas of one deployment share it.")
    config_path: str | None = setting(None, flag="--config", file=True, must_exist=True,
        help="A kiln.toml ([[models]] tables, as kiln serve --config takes): serve the model --model-id names, with its settings from the file.")
    model: str | None = setting(None, help="A GGUF file or an mlx-lm model folder. Default: the bundled SmolLM2-135M-Instruct.")
    model_id: str | None = setting(None, help="The id to serve the model under (default: from its file, folder or hub id).")
    context_length: int | None = setting(None, min=1, help="Serve at most this many tokens of context (default: the model's trained window).")
    model_alias: tuple[str, ...] = setting((), help="Another name clients may use for the model (repeatable).")
    weights: Literal["auto", "native", "float32", "float16", "bfloat16"] = setting("auto", help="Weight layout. auto: dequantized on the CPU, the model's own quantization on Metal/CUDA.")
    weight_layout: Literal["auto", "stock", "input-major"] = setting("auto", help="CPU only: how dense weights are stored for matmuls. auto measures both at start-up and keeps the faster.")
    max_batch: int = setting(8, min=1, help="Requests decoded together.")
    queue_depth: int = setting(64, min=0, help="Requests that may wait for a batch slot; more get 503.")
    prefill_chunk: int = setting(512, min=1, help="Prompt tokens processed per scheduler step.")
    cache_bytes: int = setting(1 << 30, min=0, help="Byte budget of the prefix (prompt) cache; 0 turns it off.")
    kv_cache: KVCacheType = setting("float32",
        help="KV cache storage. int8: keys and values in 8 bits (blocks of 32 with a float32 scale, as llama.cpp's -ctk/-ctv q8_0), 0.28 of float32's memory, where the native CPU pass runs "
            "every step (GGUF files); elsewhere float32 is kept, with a log line.")
    speculative: Literal["auto", "on", "off"] = setting("auto",
        help="Speculative decoding by prompt lookup: draft tokens copied from the prompt and output so far, verified in one step. auto: where a row's drafts keep being accepted; on: whenever "
            "its last tokens occurred before.")
    speculative_tokens: int = setting(4, min=1, max=16, help="Draft tokens per request per decode step, at most.")
    tool_parser: str | None = setting(None, help="Tool-call format (hermes, mistral, llama3, qwen3_coder, pythonic, ...). Default: chosen from the chat template.")
    max_output_tokens: int = setting(4096, min=1, help="Output cap when a request sets none.")
    engine: Literal["mlx", "scripted", "upstream"] = setting("mlx",
        help="scripted: a weightless engine for protocol tests and overhead benchmarks. upstream: generate on the engine --upstream names (vLLM, SGLang, llama-server); the worker keeps only the "
            "tokenizer of --model.")
    upstream: str | None = setting(None, help="With --engine upstream: the engine's base URL, e.g. http://127.0.0.1:8080.")
    upstream_kind: Literal["llama-server", "vllm", "sglang"] = setting("llama-server", help="With --engine upstream: which engine --upstream is, so which completion endpoint it takes.")
    upstream_model: str | None = setting(None, help="With --engine upstream: the model name the engine expects in requests (vLLM's --served-model-name); default: none sent.")
    upstream_api_key: str | None = setting(None, secret=True,
        help="With --engine upstream: sent as 'Authorization: Bearer' to an engine started with an API key (vLLM and SGLang --api-key, llama-server --api-key).")
    upstream_unconstrained: bool = setting(False,
        help="With --engine upstream: the engine has no constrained decoding (JSON schema), so structured output and forced tool calls are not offered and get 400.")
    scripted_reply: str = setting("Hello from Kiln's scripted engine.", help="Reply text of the scripted engine.")
    scripted_delay: float = setting(0.0, min=0, help="Seconds per token of the scripted engine.")
    scripted_load_delay: float = setting(0.0, min=0, help="Seconds the scripted engine takes to start, standing in for a slow model load.")
    log_level: LogLevel = log_level_setting()
    worker_secret: str | None = setting(None, secret=True, help="The gateway's worker secret (ZeroMQ CURVE); without the right one the gateway never sees this worker.")
    worker_secret_file: str | None = setting(None, file=True, help="Read --worker-secret from this file, so it never shows in `ps`.")
    # kiln serve's console (protocol/logs.py progress_to): never set by hand.
    progress_fd: int | None = setting(None, min=0, help="Set by kiln serve: a pipe on which the worker reports its start-up (model load, native build) as JSON lines for kiln serve's console.")
