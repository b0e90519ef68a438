"""The playground at ``/``, the operator console at ``/admin``, their files under ``/ui/``.

The pages are plain HTML, CSS and JavaScript modules in ``static/``, shipped as package data and
read into memory once when the app is built: no CDN, no build step, nothing fetched at run time, and
no path from a URL ever reaches the file system. They speak only to this gateway's own API (the
playground: /v1/...; the console: /admin/..., /health, /metrics), so every page carries a
Content-Security-Policy that allows scripts, styles and connections to this origin alone (no inline
script, no ``eval``), and no form may submit anywhere (``form-action 'none'``: a secret typed into a
page can never end up in a URL). The edge (gateway/http/edge.py) checks these requests as any other.

Which pages are served is decided here from the settings (``--playground``, ``--console``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..http.errors import ApiError
from ..settings import Settings

STATIC = Path(__file__).with_name("static")
ASSET_PREFIX = "/ui/"
CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".html": "text/html; charset=utf-8"}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def playground_on(settings: Settings) -> bool:
    """``auto``: on for a local gateway (``--auth none``), off in hosted mode."""
    choice = settings.playground
    return bool(choice == "on" or (choice == "auto" and settings.auth == "none"))


def console_on(settings: Settings) -> bool:
    """The console manages accounts, which exist in hosted mode only."""
    return bool(settings.console == "on" and settings.auth == "keys")


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str

    def response(self, request: Request) -> Response:
        headers = {**PAGE_HEADERS, "ETag": self.etag}
        if request.headers.get("if-none-match") == self.etag:
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.content_type, headers=headers)


def load_assets(folder: Path = STATIC) -> dict[str, Asset]:
    """Every file of ``folder`` by name (one level, known types only)."""
    assets = {}
    for path in sorted(folder.iterdir()):
        kind = CONTENT_TYPES.get(path.suffix)
        if kind is None or not path.is_file():
            continue
        body = path.read_bytes()
        assets[path.name] = Asset(body, kind, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
    return assets


def web_routes(settings: Settings) -> list[Route]:
    """The page routes the settings ask for (none: nothing is mounted, not even the assets)."""
    pages = []
    if playground_on(settings):
        pages.append(("/", "playground.html"))
    if console_on(settings):
        pages.append(("/admin", "console.html"))
    if not pages:
        return []
    assets = load_assets()

    def page(name: str):  # type: ignore[no-untyped-def]
        async def endpoint(request: Request) -> Response:
            return assets[name].response(request)

        return endpoint

    async def asset(request: Request) -> Response:
        found = assets.get(request.path_params["name"])
        if found is None or found.content_type.startswith("text/html"):
            return ApiError(404, "Not Found", code="not_found").response()
        return found.response(request)

    routes = [Route(path, page(name), methods=["GET", "HEAD"]) for path, name in pages]
    routes.append(Route(ASSET_PREFIX + "{name}", asset, methods=["GET", "HEAD"]))
    return routes
