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
            mine = c.post("/v1/responses", json={"model": MODEL, "input": "secret", "max_output_tokens": 4, "conversation": "shared-name"}, headers=auth(a))
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
            theirs = c.post("/v1/responses", json={"model": MODEL, "input": "hello", "max_output_tokens": 4, "conversation": "shared-name"}, headers=auth(b)).json()
            items = c.get(f"/v1/responses/{theirs['id']}/input_items", headers=auth(b)).json()["data"]
            assert len(items) == 1  # beta's conversation does not contain alpha's turn
            assert c.get(f"/v1/responses/{rid}", headers=auth(a)).status_code == 200
    finally:
        server.stop()
