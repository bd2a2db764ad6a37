"""Admin routes over every tenant's batches (gateway/batch/admin.py, issue 35 finding 1: before them only the
attacker could cancel the job that halted the lane). A platform admin lists and cancels any tenant's batch; a
tenant admin only its own tenant's: another tenant's batch is 404 and left as it was, listing another tenant
is 403; a data key is 403 on both."""
from __future__ import annotations

from tests.batch.inproc import ADMIN_KEY, KEYS, auth, lane

ADMIN = auth(ADMIN_KEY)


async def _tenant_admin(s, tenant: str) -> str:
    assert (await s.client.post("/admin/tenants", json={"id": tenant}, headers=ADMIN)).status_code == 201
    r = await s.client.post("/admin/keys", json={"tenant": tenant, "purpose": "admin"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def test_platform_admin_lists_and_cancels_any_tenants_batch_tenant_admin_only_its_own(tmp_path):
    async with lane(tmp_path, engine=False) as s:  # no engine: the batches stay open
        alpha_admin = await _tenant_admin(s, "alpha")
        a = await s.batch("alpha")
        b = await s.batch("beta")

        r = await s.client.get("/admin/batches", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert {(x["id"], x["tenant"]) for x in r.json()["data"]} == {(a["id"], "alpha"), (b["id"], "beta")}
        r = await s.client.get("/admin/batches?tenant=beta", headers=ADMIN)
        assert [x["id"] for x in r.json()["data"]] == [b["id"]] and r.json()["data"][0]["owner"] == "beta/-/-"

        r = await s.client.get("/admin/batches", headers=auth(alpha_admin))
        assert [x["id"] for x in r.json()["data"]] == [a["id"]]
        r = await s.client.get("/admin/batches?tenant=beta", headers=auth(alpha_admin))
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_forbidden"

        before = await s.get("beta", b["id"])
        r = await s.client.post(f"/admin/batches/{b['id']}/cancel", headers=auth(alpha_admin))
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        after = await s.get("beta", b["id"])
        assert after["status"] == before["status"] and after["cancelling_at"] is None

        r = await s.client.post(f"/admin/batches/{a['id']}/cancel", headers=auth(alpha_admin))
        assert r.status_code == 200 and r.json()["status"] == "cancelling" and r.json()["tenant"] == "alpha", r.text
        assert (await s.wait("alpha", a["id"]))["status"] == "cancelled"

        r = await s.client.post(f"/admin/batches/{b['id']}/cancel", headers=ADMIN)
        assert r.status_code == 200 and r.json()["status"] == "cancelling", r.text
        assert (await s.wait("beta", b["id"]))["status"] == "cancelled"
        r = await s.client.post(f"/admin/batches/{b['id']}/cancel", headers=ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "batch_not_cancellable"

        r = await s.client.get("/admin/batches?status=cancelled&limit=1", headers=ADMIN)
        assert len(r.json()["data"]) == 1 and r.json()["has_more"] is True
        nxt = await s.client.get(f"/admin/batches?status=cancelled&after={r.json()['last_id']}", headers=ADMIN)
        assert len(nxt.json()["data"]) == 1 and nxt.json()["has_more"] is False

        for method, path in (("GET", "/admin/batches"), ("POST", f"/admin/batches/{a['id']}/cancel")):
            r = await s.client.request(method, path, headers=auth(KEYS["alpha"]))  # a data key
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", (path, r.text)
            assert (await s.client.request(method, path)).status_code == 401
        for q in ("status=nope", "limit=0", "after=batch_none"):
            r = await s.client.get(f"/admin/batches?{q}", headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["message"], (q, r.text)
        assert (await s.client.post("/admin/batches/batch_none/cancel", headers=ADMIN)).status_code == 404
