"""``kiln serve``'s own settings: what it decides for its children rather than forwards.

Every other ``kiln serve`` flag is a gateway or worker setting (``gateway/settings.py``,
``worker/settings.py``), taken as those daemons take it and handed on to them mechanically.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.protocol.settings_fields import setting

# Flags kiln serve sets itself: the workers connect to the gateway it started (and only to it:
# they discover no others), the gateway asks it for on-demand models over the control socket
# it opens (protocol/control.py), and the workers report their start-up on its console's pipe.
DECIDED_FLAGS = ("--gateway", "--discover-redis", "--supervisor-fd", "--progress-fd")


@dataclass(frozen=True)
class ServeSettings:
    config_path: str | None = setting(None, flag="--config", file=True,
        help="A kiln.toml with [[models]] tables: several models, each with its own workers (replaces --model, --model-alias and --workers).")
    workers: int = setting(1, min=1, help="Worker processes to start (each loads the model).")
    # Declared here, ahead of the gateway's own --workers-bind, because the default differs.
    workers_bind: str | None = setting(None, help="ZeroMQ address between gateway and workers. Default: a private ipc:// socket of this server, so several servers on one machine never collide.")
    # Default (None): kiln/state.py default_data_dir(), $XDG_DATA_HOME/kiln or ~/.local/share/kiln.
    data_dir: str | None = setting(None,
        help="Where kiln serve keeps what outlives a restart: the key (secret-key, mode 0600) that seals reasoning handed to clients, unless --secret-key is set. Default: $XDG_DATA_HOME/kiln, "
            "else ~/.local/share/kiln.")
