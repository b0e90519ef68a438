"""Gateway settings: one typed dataclass, the single source of ``kiln-gateway``'s flags.

Each field declared with :func:`~kiln.protocol.settings_fields.setting` is a flag of
``kiln-gateway`` and of ``kiln serve`` and reads ``KILN_<FLAG>`` (and the spec's name where
``spec_env`` gives one); the click options are generated from it. Fields without ``setting`` are
tunables for code and tests only. Checks across fields live in ``gateway/cli.py`` (``checked``).
docs/configuration.md documents every flag; tests/test_settings_docs.py keeps it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.protocol import DEFAULT_WORKERS_ADDRESS
from kiln.protocol.discovery import DEFAULT_REDIS_NAMESPACE
from kiln.protocol.logs import LogLevel, log_level_setting
from kiln.protocol.settings_fields import setting


@dataclass
class Settings:
    host: str = setting("127.0.0.1", help="Address to listen on.")
    port: int = setting(8080, min=0, max=65535, help="HTTP port.")
    workers_bind: str = setting(DEFAULT_WORKERS_ADDRESS, help="ZeroMQ address workers connect to.")
    # The deployment's model list (protocol/model_config.py): models not loaded yet are listed,
    # and answer 503 rather than 404; on-demand ones are started through the supervisor.
    config_path: str | None = setting(None, flag="--config", file=True, must_exist=True, help="A kiln.toml ([[models]] tables, as kiln serve --config takes): list its models, answer 503 (not 404) for one whose workers are not up, load on-demand ones through kiln serve.")
    # kiln serve's end of the control channel (protocol/control.py); never set by hand.
    supervisor_fd: int | None = setting(None, min=0, help="Set by kiln serve: the socket on which the gateway asks it to start and stop on-demand models.")
    load_timeout_s: float = setting(120.0, flag="--load-timeout", min=0, min_open=True, help="Seconds a request waits for an on-demand model to load before it gets 503 with Retry-After (the load goes on).")
    max_body_bytes: int = setting(32 << 20, min=1, help="Largest request body accepted; larger ones get 413.")
    heartbeat_timeout_s: float = setting(5.0, flag="--heartbeat-timeout", min=0, min_open=True, help="Seconds of worker silence before its requests are failed.")
    # Bounded waiting: how long a worker may take to send a request's first message (prefill,
    # queueing, compaction) and then each next one, before the request fails with 504 /
    # response.failed and frees its slots.
    first_event_timeout_s: float = setting(300.0, flag="--first-event-timeout", min=0, min_open=True, help="Seconds a worker may take to start answering a request (queueing, prefill, compaction) before it fails with 504.")
    event_timeout_s: float = setting(60.0, flag="--event-timeout", min=0, min_open=True, help="Seconds a worker may stay silent between two events of a request (its progress while it prefills a long prompt counts) before it fails with 504.")
    # "reject" answers 400 as the spec says; "drop" removes them so clients that always send them
    # (Codex) still work.
    hosted_tools: Literal["reject", "drop"] = setting("reject", help="Hosted tool types (web_search, ...): answer 400, or drop them from the request.")
    # The spec: a foreground response has no "background" key; OpenAI's schema requires it.
    echo_background: bool = setting(False, help='Every Response carries "background" (false on foreground ones), for clients that validate against OpenAI\'s schema strictly. Off: only background responses have the key, as the spec says.')
    # The spec refuses truncation "auto"; clients that always send it (the Agents SDK) need this.
    truncation_auto: bool = setting(False, help='Accept truncation: "auto": the oldest whole turns are left out of what is rendered until the input fits the context window. Off: "auto" is a 400, as the spec says.')
    log_level: LogLevel = log_level_setting()
    # Server key that seals reasoning handed to clients (gateway/lifecycle/sealing.py).
    secret_key: str | None = setting(None, secret=True, help="Key that seals the reasoning handed to clients in encrypted_content. Set the same key on every gateway replica; default: random per process (kiln serve: kept in its --data-dir).")
    encrypt_reasoning: bool = setting(False, help="Encrypt the reasoning in encrypted_content (AES-256-GCM under --secret-key) so that clients cannot read it from the blob; default: signed, readable base64url JSON.")
    reasoning_echo_max_bytes: int = setting(16 << 20, min=0, spec_env="MLXCEL_REASONING_ECHO_MAX_BYTES", help="Byte budget of the reasoning echo store; 0 turns it off.")
    # None: OpenAI's default, 1.0.
    default_temperature: float | None = setting(None, min=0, max=2, help="Temperature for requests that do not set one (default: 1, as OpenAI). Small models ramble less at 0-0.7; clients such as Codex never send one.")
    # None: OpenAI's default, 0.
    default_frequency_penalty: float | None = setting(None, min=-2, max=2, help="frequency_penalty for requests that do not set one (default: 0, as OpenAI). A small model that repeats itself until the output cap stops at 0.3-0.5; clients rarely send one.")
    # The response store (spec: Storage Flags). "none" is the hosted contract's store-less gateway;
    # "redis" shares the stores between gateway replicas through redis_url (docs/deploy-state.md).
    store_mode: Literal["memory", "redis", "none"] = setting("memory", flag="--store", help="memory: keep responses as the Responses API describes, in this process. redis: the same, shared by every gateway replica through --redis-url. none: the hosted contract's store-less gateway.")
    responses_store_max_entries: int = setting(1024, min=0, spec_env="LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES", help="Stored responses kept; 0 turns response persistence off.")
    responses_store_max_bytes: int = setting(268435456, min=0, spec_env="MLXCEL_RESPONSES_STORE_MAX_BYTES", help="Approximate byte budget of stored responses (and of active background jobs); 0 evicts at once.")
    responses_store_ttl_secs: int = setting(3600, min=0, spec_env="LLAMA_ARG_RESPONSES_STORE_TTL_SECS", help="Seconds a stored response lives; 0 means no expiry.")
    responses_background_max_jobs: int = setting(64, min=0, spec_env="MLXCEL_RESPONSES_BACKGROUND_MAX_JOBS", help="Background responses running at once; 0 turns background mode off.")
    # The spec: "At least 1; 0 fails startup" (a finished store:false job needs a time to be read).
    responses_background_ephemeral_ttl_secs: int = setting(600, min=1, spec_env="MLXCEL_RESPONSES_BACKGROUND_EPHEMERAL_TTL_SECS", help="Seconds a finished store:false background response stays readable (at least 1).")
    # --store redis: how long a replica may stop renewing its jobs' leases (it died) before another
    # replica fails them (store/redis/jobs.py).
    responses_background_lease_secs: int = setting(30, min=1, help="With --store redis: a background job whose replica stops renewing its lease ends failed within this many seconds (at least 1).")
    conversation_store_max_entries: int = setting(256, min=0, spec_env="LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES", help="Conversation transcripts kept; 0 turns conversations off.")
    conversation_store_max_bytes: int = setting(67108864, min=0, spec_env="MLXCEL_CONVERSATION_STORE_MAX_BYTES", help="Approximate byte budget of transcripts; 0 evicts at once.")
    conversation_store_ttl_secs: int = setting(3600, min=0, spec_env="LLAMA_ARG_CONVERSATION_STORE_TTL_SECS", help="Seconds a transcript lives; 0 means no expiry.")
    # Hosted mode (spec/hosted-gateway.md; docs/hosted.md): API keys per organization, metering,
    # credits and concurrency limits from the accounts database.
    auth: Literal["none", "keys"] = setting("none", help="keys: API keys per organization, metering, credits and concurrency limits (needs --database-url).")
    database_url: str | None = setting(None, secret=True, help="Accounts database: sqlite:///PATH or postgresql://USER@HOST/DB.")
    catalog_path: str | None = setting(None, flag="--catalog", file=True, must_exist=True, help="TOML model catalog with prices; other models get 404 model_not_found. Without it every served model is free.")
    redis_url: str | None = setting(None, secret=True, help="Redis shared by gateway replicas: per-organization concurrency and the maintenance switch (--auth keys), the stores (--store redis). Default: in-process.")
    redis_namespace: str = setting(DEFAULT_REDIS_NAMESPACE, help="Key prefix in Redis; replicas of one deployment share it.")
    advertise_workers: str | None = setting(None, help="ZeroMQ address workers should connect to (this replica's --workers-bind as they reach it), advertised in Redis (--redis-url) under a lease, so that workers with --discover-redis find this replica.")
    admin_token: str | None = setting(None, secret=True, help="Bearer token for /admin/maintenance (off without it).")
    admin_token_file: str | None = setting(None, file=True, must_exist=True, help="File holding the admin token (kept out of `ps`, unlike --admin-token).")
    allow_public_no_auth: bool = setting(False, help="Allow --auth none on a non-loopback address.")
    # The web pages (gateway/web/; docs/web.md): the playground talks to this gateway's public API
    # from a browser; the console drives the admin API with the admin token typed into it.
    playground: Literal["auto", "on", "off"] = setting("auto", help="The web playground at /: auto serves it with --auth none and not with --auth keys.")
    console: Literal["on", "off"] = setting("on", help="The operator console at /admin with --auth keys (it signs in with the admin token).")
    auth_cache_ttl: float = 2.0
    # Shared secret workers must hold to connect (ZeroMQ CURVE; docs/protocol.md). None: plain
    # ZeroMQ, allowed only on loopback or ipc:// addresses.
    worker_secret: str | None = setting(None, secret=True, help="Shared secret workers must hold to connect (ZeroMQ CURVE, encrypted). Required for a --workers-bind other hosts can reach.")
    worker_secret_file: str | None = setting(None, file=True, help="Read --worker-secret from this file, so it never shows in `ps`.")
    # Without a secret any local process could register as a worker, read every tenant's prompts
    # and report usage: only an operator who says so runs that way (gateway/cli.py).
    allow_unauthenticated_workers: bool = setting(False, help="Accept workers without a worker secret (plain ZeroMQ, loopback or ipc:// only): any local process could then serve, read and bill requests.")
    # The HTTP edge (gateway/http/edge.py): body deadline, concurrent-request cap, Host and Origin rules.
    body_timeout_s: float = setting(30.0, flag="--body-timeout", min=0, help="Seconds a request body may take to arrive; slower ones get 408 and the connection is closed. 0: no bound.")
    body_buffer_bytes: int = setting(256 << 20, min=0, help="Bytes of request bodies still arriving, over all requests; a chunk past it gets 503 with Retry-After. 0: no bound.")
    max_connections: int = setting(1024, min=0, help="HTTP requests served at once (streams included); beyond it, 503 with Retry-After. 0: no cap.")
    keep_alive_timeout_s: float = setting(75.0, flag="--keep-alive-timeout", min=0, min_open=True, help="Seconds an idle connection stays open, and the most a client may take to send its request headers.")
    # None: loopback names on a loopback bind, else any (gateway/http/edge.py normalizes the names).
    allowed_hosts: tuple[str, ...] | None = setting(None, separator=",", help="Comma list of Host names accepted besides loopback ones (* = any). Default: loopback names only when listening on loopback with --auth none, else any.")
    cors_origins: tuple[str, ...] | None = setting(None, separator=",", help="Comma list of web origins (https://app.example) allowed to call the API from a browser (* = any).")
    # WebSocket mode on /v1/responses (gateway/doors/websocket/routes.py; docs/websocket.md). "off"
    # answers the upgrade with 426 so clients fall back to HTTP.
    websocket: Literal["on", "off"] = setting("on", help="WebSocket mode on /v1/responses; off answers the upgrade with 426 so clients use HTTP.")
    websocket_max_connections: int = 256  # sockets open at once; beyond, the upgrade gets 503
    # Sockets one organization may hold open (hosted mode); beyond, its upgrade gets 429, so one
    # tenant's idle sockets cannot take the whole server's.
    websocket_max_connections_per_org: int = 32
    websocket_max_age_s: float = 3600.0  # a connection's lifetime (OpenAI's 60 minutes)
    websocket_ping_interval_s: float = 20.0  # server pings keep idle sockets through proxies
