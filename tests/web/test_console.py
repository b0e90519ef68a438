"""The operator console in a real headless browser against a hosted gateway (``--auth keys``,
SQLite, a price catalog, the bundled model): sign in with the admin token, create an organization
and a key, use the key with the OpenAI SDK, revoke it (401), top up, and see the requests just made
on the usage chart. Plus the console's defences, over plain HTTP: the admin API needs the token,
refuses a foreign Origin, and the token never lands in a URL, web storage or a cookie. One server
and one browser for the module. Screenshots: build/screenshots/console-*.png."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest

from tests.support import Kiln

from .browser import PHONE, all_by_testid, by_testid, console_errors, screenshot, too_wide, wait_for

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m-instruct"
TOKEN = "admin-" + secrets.token_hex(12)
CATALOG = f"""
[models."{MODEL}"]
input = "0.20"
cached_input = "0.10"
output = "0.60"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    (tmp / "catalog.toml").write_text(CATALOG)
    # The playground too (off by default in hosted mode): it asks for an API key.
    args = ["--auth", "keys", "--database-url", f"sqlite:///{tmp}/kiln.db", "--catalog", str(tmp / "catalog.toml"), "--store", "none", "--playground", "on"]
    kiln = Kiln(tmp, gateway_args=args, worker_args=["--max-batch", "4"], env={"KILN_ADMIN_TOKEN": TOKEN}).start()
    yield kiln
    kiln.stop()


@pytest.fixture
def console(browser, server):
    """The console, signed in."""
    browser.get(server.base_url + "/admin")
    by_testid(browser, "admin-token").send_keys(TOKEN)
    by_testid(browser, "sign-in").click()
    wait_for(browser, lambda d: by_testid(d, "orgs").is_displayed(), 30, "the console did not sign in")
    return browser


def set_value(driver, testid: str, value: str) -> None:
    field = by_testid(driver, testid)
    field.clear()
    field.send_keys(value)


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_an_org_and_a_key_made_in_the_console_work_until_revoked(console, server):
    org = "acme-" + secrets.token_hex(3)
    set_value(console, "org-name", org)
    set_value(console, "org-credits", "2.5")
    by_testid(console, "create-org").click()
    wait_for(console, lambda d: org in by_testid(d, "keys-org").text, 30, "the new organization was not selected")
    assert org in by_testid(console, "orgs").text
    assert by_testid(console, "balance").text == "2.5"

    scope = next(box for box in all_by_testid(console, "key-scope") if box.get_attribute("value") == MODEL)
    scope.click()  # the key may use this model only
    by_testid(console, "create-key").click()
    key = wait_for(console, lambda d: by_testid(d, "new-key").text, 30, "no key was shown")
    assert key.startswith("sk-kiln-")
    assert MODEL in by_testid(console, "keys").text

    client = sdk(server, key)
    for prompt in ("Say hi.", "Say bye."):
        answer = client.responses.create(model=MODEL, input=prompt, max_output_tokens=8)
        assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert chat.choices[0].message.content

    # The chart shows those three requests, under the organization's name.
    by_testid(console, "usage-refresh").click()
    legend = wait_for(console, lambda d: [s for s in all_by_testid(d, "usage-legend")[0].find_elements("css selector", f"[data-series='{org}']") if s.get_attribute("data-requests") == "3"], 30,
        "the chart does not show the requests")
    assert legend[0].text.startswith(f"{org}: 3")
    chart = by_testid(console, "usage-chart").find_element("css selector", "svg")
    assert int(chart.get_attribute("data-requests")) >= 3
    assert chart.find_elements("css selector", f"rect[data-series='{org}']")
    wait_for(console, lambda d: by_testid(d, "metric-requests").text.split("\n")[0] not in ("0", "–"), 15)
    screenshot(console, "console-usage")

    # Credits: the balance went down by what was billed; a top-up adds to it.
    console.find_element("css selector", f"[data-testid='manage-org'][data-org='{org}']").click()
    spent = wait_for(console, lambda d: by_testid(d, "balance").text != "2.5" and by_testid(d, "balance").text, 15)
    set_value(console, "topup-amount", "1")
    by_testid(console, "topup").click()
    wait_for(console, lambda d: by_testid(d, "balance").text != spent, 15, "the top-up did not show")
    assert abs(float(by_testid(console, "balance").text) - (float(spent) + 1)) < 1e-9

    # Revoke (two clicks: the first arms the button), then the key is refused.
    revoke = by_testid(console, "revoke")
    revoke.click()
    revoke.click()
    wait_for(console, lambda d: by_testid(d, "key-status").text == "revoked", 15, "the key was not revoked")
    with pytest.raises(openai.AuthenticationError) as refused:
        client.responses.create(model=MODEL, input="Still there?", max_output_tokens=4)
    assert refused.value.status_code == 401
    assert console_errors(console) == []
    screenshot(console, "console-keys")


def test_the_admin_token_is_never_stored_or_put_in_a_url(console):
    assert TOKEN not in console.current_url
    stored = console.execute_script("return JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage), document.cookie])")
    assert TOKEN not in stored
    assert by_testid(console, "admin-token").get_attribute("value") == ""
    console.refresh()  # a reload forgets it: sign in again
    wait_for(console, lambda d: by_testid(d, "admin-token").is_displayed(), 15)
    assert not by_testid(console, "orgs").is_displayed()


def test_a_wrong_token_is_refused_and_phone_width_fits(browser, server):
    browser.set_window_size(*PHONE)
    try:
        browser.get(server.base_url + "/admin")
        by_testid(browser, "admin-token").send_keys("not-the-token")
        by_testid(browser, "sign-in").click()
        wait_for(browser, lambda d: "refused" in d.find_element("id", "signin-error").text, 15)
        screenshot(browser, "console-signin-phone")
        by_testid(browser, "admin-token").send_keys(TOKEN)
        by_testid(browser, "sign-in").click()
        wait_for(browser, lambda d: by_testid(d, "orgs").is_displayed(), 30)
        assert too_wide(browser) == []
        screenshot(browser, "console-phone")
    finally:
        browser.set_window_size(1280, 1000)


def test_the_admin_api_is_guarded(server):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        page = http.get("/admin")
        assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
        assert "form-action 'none'" in page.headers["content-security-policy"]
        assert http.get("/admin/orgs").status_code == 401
        assert http.get("/admin/orgs", headers={"Authorization": "Bearer sk-kiln-nope"}).status_code == 401
        body = {"name": "csrf-" + secrets.token_hex(3), "credits_usd": "1"}
        foreign = http.post("/admin/orgs", json=body, headers={**bearer, "Origin": "https://evil.example"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "permission_denied"
        form = http.post("/admin/orgs", content=b"name=x", headers={**bearer, "Content-Type": "application/x-www-form-urlencoded"})
        assert form.status_code == 415  # the edge: a form post cannot reach it
        own = http.post("/admin/orgs", json=body, headers={**bearer, "Origin": server.base_url})
        assert own.status_code == 201, own.text
        again = http.post("/admin/orgs", json=body, headers=bearer)
        assert again.status_code == 409
        whole = http.post(f"/admin/keys/sk-kiln-{'a' * 40}/revoke", headers=bearer)
        assert whole.status_code == 400  # never a whole key in a URL
        too_many = http.get("/admin/usage?bucket=1&start_time=0&end_time=100000", headers=bearer)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "bucket"


def test_the_hosted_playground_asks_for_a_key(browser, server):
    from selenium.webdriver.common.keys import Keys

    bearer = {"Authorization": f"Bearer {TOKEN}"}
    org = "play-" + secrets.token_hex(3)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.post("/admin/orgs", json={"name": org, "credits_usd": "1"}, headers=bearer).status_code == 201
        key = http.post(f"/admin/orgs/{org}/keys", json={"models": None}, headers=bearer).json()["key"]
    browser.get(server.base_url + "/")
    field = wait_for(browser, lambda d: by_testid(d, "api-key").is_displayed() and by_testid(d, "api-key"), 30, "no API key field")
    field.send_keys(key, Keys.TAB)
    wait_for(browser, lambda d: by_testid(d, "model").get_attribute("value") == MODEL, 30, "the models were not listed with the key")
    pick_continuation = browser.find_element("css selector", "[data-testid='continuation'] option[value='resend']")
    pick_continuation.click()  # --store none: the page sends the history itself
    by_testid(browser, "prompt").send_keys("Say hi.")
    by_testid(browser, "send").click()
    wait_for(browser, lambda d: by_testid(d, "response-id").text.startswith("resp_") and by_testid(d, "send").is_enabled() and by_testid(d, "status").text.startswith("Done"), 300, "no answer")
    assert by_testid(browser, "answer").text.strip()
    assert key not in browser.execute_script("return JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage), document.cookie])")
