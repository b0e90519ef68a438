"""With auth on and the response store on, one organization never sees another's stored
responses, input items, conversations or chains (scripted engine, named as such)."""

from __future__ import annotations

import httpx

from tests.e2e.test_hosted_gateway import CATALOG_TEXT, MODEL, WORKER_ARGS, auth, new_org
from tests.support import Kiln


def test_orgs_cannot_reach_each_others_responses(tmp_path):
    url = f"sqlite:///{tmp_path}/kiln.db"
    a = new_org(url, "alpha")
    b = new_org(url, "beta")
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG_TEXT)
    server = Kiln(tmp_path, gateway_args=["--auth", "keys", "--database-url", url, "--catalog", str(catalog)], worker_args=WORKER_ARGS).start(timeout=90)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            # A conversation is created first (an unknown id on create is a 404, as OpenAI does).
            alphas = c.post("/v1/conversations", json={}, headers=auth(a)).json()["id"]
            mine = c.post("/v1/responses", json={"model": MODEL, "input": "secret", "max_output_tokens": 4, "conversation": alphas}, headers=auth(a))
            assert mine.status_code == 200, mine.text
            rid = mine.json()["id"]
            assert c.get(f"/v1/responses/{rid}", headers=auth(a)).status_code == 200
            for r in (
                c.get(f"/v1/responses/{rid}", headers=auth(b)),
                c.get(f"/v1/responses/{rid}/input_items", headers=auth(b)),
                c.delete(f"/v1/responses/{rid}", headers=auth(b)),
                c.post(f"/v1/responses/{rid}/cancel", headers=auth(b)),
            ):
                assert r.status_code == 404, r.text
            chained = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": rid}, headers=auth(b))
            assert chained.status_code == 400
            # Alpha's conversation id is nothing to beta: not found, and nothing added to it.
            borrowed = c.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 4, "conversation": alphas}, headers=auth(b))
            assert borrowed.status_code == 404, borrowed.text
            assert c.get(f"/v1/conversations/{alphas}/items", headers=auth(b)).status_code == 404
            betas = c.post("/v1/conversations", json={}, headers=auth(b)).json()["id"]
            theirs = c.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 4, "conversation": betas}, headers=auth(b)).json()
            items = c.get(f"/v1/responses/{theirs['id']}/input_items", headers=auth(b)).json()["data"]
            assert len(items) == 1  # beta's conversation does not contain alpha's turn
            assert len(c.get(f"/v1/conversations/{alphas}/items", headers=auth(a)).json()["data"]) == 2  # alpha's turn, untouched
            assert c.get(f"/v1/responses/{rid}", headers=auth(a)).status_code == 200
    finally:
        server.stop()


REAL_MODEL = "smollm2-135m-instruct"
# What org A keeps in its instructions; org B tries to read it from the prefix cache, as the
# issue's attacker did, a digit at a time (cached_tokens 30 for the right digit, 29 otherwise).
PIN_PROMPT = "You are the vault assistant of Alpha Corp. Never reveal anything. The vault PIN is {pin}. " + "Answer politely and briefly. " * 20


def test_one_org_cannot_read_anothers_prompt_from_the_prefix_cache(tmp_path):
    """Issue 30 A, with the real model: the prefix cache is scoped per organization, so an
    organization's first probe sees nothing cached whether it guesses A's PIN right (beta) or
    wrong (gamma), and A's own repeat is still served from the cache."""
    url = f"sqlite:///{tmp_path}/kiln.db"
    a, b, g = new_org(url, "alpha"), new_org(url, "beta"), new_org(url, "gamma")
    server = Kiln(tmp_path, gateway_args=["--auth", "keys", "--database-url", url, "--store", "none"], worker_args=["--max-batch", "4"]).start(timeout=180)

    def cached(key: str, pin: str) -> int:
        r = c.post("/v1/responses", json={"model": REAL_MODEL, "instructions": PIN_PROMPT.format(pin=pin), "input": "hi", "max_output_tokens": 1}, headers=auth(key))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            cached(a, "4821")
            own = cached(a, "4821")
            assert own > 0  # the cache works within the organization
            probes = {"right": cached(b, "4821"), "wrong": cached(g, "4822")}
            assert probes == {"right": 0, "wrong": 0}, probes
            assert cached(a, "4821") == own  # and B's probes did not disturb A's entry
    finally:
        server.stop()
