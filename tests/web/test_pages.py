"""The pages as files and routes, without a browser: which pages each mode serves, the security
headers they carry, that every file they load ships in the package and nothing comes from
elsewhere (they work offline), no inline script, and what a first visit weighs."""

from __future__ import annotations

import re
from dataclasses import replace

import httpx
import pytest
from starlette.applications import Starlette

from kiln.gateway.settings import Settings
from kiln.gateway.web.pages import STATIC, load_assets, web_routes

PAGES = ("playground.html", "console.html")


def client(settings: Settings) -> httpx.AsyncClient:
    app = Starlette(routes=web_routes(settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


@pytest.mark.parametrize("auth, playground, console, served", [
    ("none", "auto", "on", {"/": 200, "/admin": 404}),
    ("keys", "auto", "on", {"/": 404, "/admin": 200}),
    ("keys", "on", "off", {"/": 200, "/admin": 404}),
    ("none", "off", "on", {"/": 404, "/admin": 404, "/ui/kiln.css": 404}),
])
async def test_the_flags_decide_the_pages(auth, playground, console, served):
    settings = replace(Settings(), auth=auth, playground=playground, console=console)
    async with client(settings) as http:
        for path, status in served.items():
            assert (await http.get(path)).status_code == status, path


async def test_pages_carry_a_strict_policy_and_assets_their_types():
    async with client(Settings()) as http:
        page = await http.get("/")
        policy = page.headers["content-security-policy"]
        for rule in ("default-src 'none'", "script-src 'self'", "connect-src 'self'", "form-action 'none'", "frame-ancestors 'none'"):
            assert rule in policy
        assert "unsafe" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["content-type"].startswith("text/html")
        script = await http.get("/ui/playground.js")
        assert script.headers["content-type"].startswith("text/javascript")
        again = await http.get("/ui/playground.js", headers={"If-None-Match": script.headers["etag"]})
        assert again.status_code == 304
        for missing in ("/ui/nope.js", "/ui/console.html", "/ui/..%2Fpages.py"):
            assert (await http.get(missing)).status_code == 404, missing


def references(name: str, text: str) -> set[str]:
    """Files a page or module loads: src/href in HTML, imports in JS."""
    if name.endswith(".html"):
        return {m.removeprefix("/ui/") for m in re.findall(r'(?:src|href)="([^"]+)"', text)}
    if name.endswith(".js"):
        return {m.removeprefix("./") for m in re.findall(r'from "([^"]+)"', text)}
    return set()


def closure(page: str) -> set[str]:
    seen, todo = set(), [page]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += references(name, (STATIC / name).read_text())
    return seen


@pytest.mark.parametrize("page", PAGES)
def test_a_page_loads_only_its_own_files_and_weighs_little(page):
    assets = load_assets()
    files = closure(page)
    assert files <= set(assets), f"referenced but not shipped: {files - set(assets)}"
    for name in files:
        text = (STATIC / name).read_text()
        assert not re.search(r"(?:src|href|url\()\s*=?\s*[\"']?(?:https?:)?//", text), f"{name} loads something from elsewhere"
        if name.endswith(".html"):
            assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"inline script in {name}"
            assert " style=" not in text and "<style" not in text, f"inline style in {name}"
            assert re.search(r'<meta name="viewport" content="width=device-width', text)
    weight = sum(len(assets[name].body) for name in files)
    print(f"{page}: {len(files)} files, {weight / 1024:.1f} KiB uncompressed")
    assert weight < 100 * 1024


@pytest.mark.parametrize("page, hooks", [
    ("playground.html", ("model", "prompt", "send", "output", "usage", "response-id", "api")),
    ("console.html", ("orgs", "keys", "create-key", "usage-chart")),
])
def test_the_test_hooks_are_there(page, hooks):
    text = (STATIC / page).read_text()
    for hook in hooks:
        assert f'data-testid="{hook}"' in text, hook


def test_every_field_has_a_label():
    for page in PAGES:
        text = (STATIC / page).read_text()
        labelled = set(re.findall(r'<label[^>]*for="([^"]+)"', text))
        labelled |= set(re.findall(r'<label[^>]*>(?:(?!</label>).)*?\bid="([^"]+)"', text, re.DOTALL))  # wrapped
        for field_id in re.findall(r'<(?:input|select|textarea)[^>]*id="([^"]+)"', text):
            assert field_id in labelled, f"{page}: #{field_id} has no label"
