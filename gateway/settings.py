"""Gateway settings: one dataclass, filled by the CLI from flags and environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.protocol import DEFAULT_WORKERS_ADDRESS


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    workers_bind: str = DEFAULT_WORKERS_ADDRESS
    max_body_bytes: int = 32 << 20
    heartbeat_timeout_s: float = 5.0
    # Bounded waiting: how long a worker may take to send a request's first message (prefill,
    # queueing, compaction) and then each next one, before the request fails with 504 /
    # response.failed and frees its slots.
    first_event_timeout_s: float = 300.0
    event_timeout_s: float = 60.0
    # What to do with hosted built-in tool types (web_search, ...): "reject" answers 400 as the
    # spec says; "drop" removes them so clients that always send them (Codex) still work.
    hosted_tools: str = "reject"
    # The response store (spec: Storage Flags). store_mode "none" is the hosted contract's
    # store-less gateway; "memory" is the local default; "redis" shares the stores between
    # gateway replicas through redis_url (docs/deploy-state.md).
    store_mode: str = "memory"
    responses_store_max_entries: int = 1024
    responses_store_max_bytes: int = 268435456
    responses_store_ttl_secs: int = 3600
    responses_background_max_jobs: int = 64
    responses_background_ephemeral_ttl_secs: int = 600
    responses_background_lease_secs: int = 30  # --store redis: a dead replica's jobs fail within it
    conversation_store_max_entries: int = 256
    conversation_store_max_bytes: int = 67108864
    conversation_store_ttl_secs: int = 3600
    # Server key that seals reasoning and compaction content handed to clients.
    secret_key: str | None = None
    reasoning_echo_max_bytes: int = 16 << 20
    # Sampling temperature for requests that set none (OpenAI's default, 1.0, when None).
    default_temperature: float | None = None
    # Hosted mode (spec/hosted-gateway.md; docs/hosted.md). auth "keys": API keys per organization,
    # metering, credits and concurrency limits from the accounts database.
    auth: str = "none"
    database_url: str | None = None
    catalog_path: str | None = None
    redis_url: str | None = None
    redis_namespace: str = "kiln"
    admin_token: str | None = None
    allow_public_no_auth: bool = False
    auth_cache_ttl: float = 2.0
    # Shared secret workers must hold to connect (ZeroMQ CURVE; docs/protocol.md). None: plain
    # ZeroMQ, allowed only on loopback or ipc:// addresses.
    worker_secret: str | None = None
    # The HTTP edge (gateway/edge.py): body deadline, concurrent-request cap, Host and Origin rules.
    body_timeout_s: float = 30.0
    body_buffer_bytes: int = 256 << 20  # bytes of bodies still arriving, over all requests
    max_connections: int = 1024
    keep_alive_timeout_s: float = 75.0
    allowed_hosts: tuple[str, ...] | None = None  # None: loopback names on a loopback bind, else any
    cors_origins: tuple[str, ...] | None = None
    # WebSocket mode on /v1/responses (gateway/routes/websocket.py; docs/websocket.md). "off"
    # answers the upgrade with 426 so clients fall back to HTTP.
    websocket: str = "on"
    websocket_max_connections: int = 256  # sockets open at once; beyond, the upgrade gets 503
    websocket_max_age_s: float = 3600.0  # a connection's lifetime (OpenAI's 60 minutes)
    websocket_ping_interval_s: float = 20.0  # server pings keep idle sockets through proxies
    extra: dict = field(default_factory=dict)
