"""``kiln-gateway`` with the request log installed (http/request_log.py), for the Codex end-to-end
tests and for debugging a client: ``python -m kiln.gateway.logged_cli ARGS`` (needs $KILN_REQUEST_LOG).

Its own module, not a ``main`` in the request log, so that the log does not import the app and the
command that imports it (no import loop)."""

from __future__ import annotations

from typing import Any

from .cli import main as gateway_main
from .http import app as app_module
from .http.request_log import install_request_log


def main() -> None:
    """``kiln-gateway`` with the request log installed (needs $KILN_REQUEST_LOG)."""
    create_app = app_module.create_app

    def create_app_with_log(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        install_request_log(app)
        return app

    app_module.create_app = create_app_with_log
    gateway_main()


if __name__ == "__main__":
    main()
