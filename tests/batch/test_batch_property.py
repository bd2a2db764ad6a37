"""Property: no sequence of batch API calls by one principal changes another principal's batches or files.

The real routes (/v1/files, /v1/batches, /admin/batches) over the real BatchService and SQLite store, with the
lane's loop not running (it is not an API call, and it would move the victim's jobs on its own). The victim
(tenant beta, no project) has a validating batch, an in-progress one and their input files. Attackers: another
tenant's data key, a data key of the victim's own tenant in another project, and another tenant's admin key.
Hypothesis draws up to 10 calls, each naming the victim's ids, the attacker's own or made-up ones; after them
the victim's job rows, line rows and files are exactly as before, and no call naming a victim id succeeded."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import Gateway, build_app
from gateway.config import load_config
from gateway.wiring import wire
from tests.batch.inproc import ADMIN_KEY, KEYS, auth, config, jsonl, line

SAME_TENANT = "batch-prop-beta-p2-0123456789"
ATTACKERS = {"alpha": KEYS["alpha"], "beta-p2": SAME_TENANT}  # data keys; "admin": alpha's tenant admin key

REFS = st.sampled_from(["victim_validating", "victim_running", "victim_file", "victim_file2", "own_batch",
                        "own_file", "junk"])
ACTIONS = st.one_of(
    st.tuples(st.just("upload"), st.booleans()),
    st.tuples(st.sampled_from(["create", "file_get", "file_delete", "file_content", "batch_get", "batch_cancel",
                               "list_batches", "list_files", "admin_cancel", "admin_list"]), REFS),
)


class World:
    def __init__(self, client: httpx.AsyncClient, svc: Any, victim: dict[str, str], admin_key: str) -> None:
        self.c, self.svc, self.victim, self.admin_key = client, svc, victim, admin_key
        self.own: dict[str, str] = {"own_batch": "batch_unknown", "own_file": "file-unknown"}

    def ref(self, r: str) -> str:
        return self.victim.get(r) or self.own.get(r) or "x_" + r

    async def snapshot(self) -> Any:
        st_ = self.svc.store
        jobs = [await st_.get_job(self.victim[k], None) for k in ("victim_validating", "victim_running")]
        files = [await st_.file_content(self.victim[k], "beta/-/-") for k in ("victim_file", "victim_file2")]
        async with st_._tx() as tx:
            lines = await tx.fetch("SELECT * FROM batch_lines WHERE batch_id IN (?, ?) ORDER BY batch_id, line_no",
                                   self.victim["victim_validating"], self.victim["victim_running"])
            frows = await tx.fetch("SELECT * FROM batch_files WHERE id IN (?, ?) ORDER BY id",
                                   self.victim["victim_file"], self.victim["victim_file2"])
        return jobs, files, lines, frows

    async def act(self, who: str, action: tuple[str, Any]) -> None:
        kind, arg = action
        key = self.admin_key if kind.startswith("admin") else ATTACKERS[who]
        h = auth(key)
        target = self.ref(arg) if isinstance(arg, str) else ""
        if kind == "upload":
            data = jsonl(2) if arg else b"{not json\n"
            r = await self.c.post("/v1/files", headers=h, data={"purpose": "batch"},
                                  files={"file": ("in.jsonl", data, "application/jsonl")})
            if r.status_code == 200:
                self.own["own_file"] = r.json()["id"]
        elif kind == "create":
            r = await self.c.post("/v1/batches", headers=h, json={"input_file_id": target, "completion_window": "24h",
                                                                 "endpoint": "/v1/chat/completions"})
            if r.status_code == 200:
                self.own["own_batch"] = r.json()["id"]
        elif kind in ("file_get", "file_delete", "file_content"):
            path = f"/v1/files/{target}" + ("/content" if kind == "file_content" else "")
            r = await self.c.request("DELETE" if kind == "file_delete" else "GET", path, headers=h)
        elif kind == "batch_get":
            r = await self.c.get(f"/v1/batches/{target}", headers=h)
        elif kind == "batch_cancel":
            r = await self.c.post(f"/v1/batches/{target}/cancel", headers=h)
        elif kind == "list_batches":
            r = await self.c.get(f"/v1/batches?after={target}", headers=h)
        elif kind == "list_files":
            r = await self.c.get(f"/v1/files?after={target}", headers=h)
        elif kind == "admin_cancel":
            r = await self.c.post(f"/admin/batches/{target}/cancel", headers=h)
        else:
            r = await self.c.get("/admin/batches" + ("?tenant=beta" if arg.startswith("victim") else ""), headers=h)
        assert r.status_code < 500, (who, action, r.status_code, r.text)
        if target in self.victim.values():
            assert r.status_code in (400, 403, 404), (who, action, r.status_code, r.text)
        if r.status_code == 200:  # never listed, never shown as found (a 404 may echo the id asked for)
            for v in self.victim.values():
                assert v not in r.text, (who, action, r.text)


def test_no_sequence_of_calls_by_one_principal_changes_anothers_batches(tmp_path):
    loop = asyncio.new_event_loop()
    path = config(tmp_path, None, keys=[{"name": "beta-p2", "key": SAME_TENANT, "tenant": "beta",
                                         "project": "p2"}])
    gw = Gateway(load_config(path))
    wire(gw)
    svc = gw.batch
    gw.services.remove(svc)  # the API and the store, not the lane's loop
    app = build_app(gw)

    async def setup() -> tuple[httpx.AsyncClient, World]:
        await svc.store.open()
        await svc.store.migrate()
        await gw.start()
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30)
        assert (await c.post("/admin/tenants", json={"id": "alpha"}, headers=auth(ADMIN_KEY))).status_code == 201
        r = await c.post("/admin/keys", json={"tenant": "alpha", "purpose": "admin"}, headers=auth(ADMIN_KEY))
        admin_key = r.json()["key"]
        victim: dict[str, str] = {}
        for fk, bk in (("victim_file", "victim_running"), ("victim_file2", "victim_validating")):
            r = await c.post("/v1/files", headers=auth(KEYS["beta"]), data={"purpose": "batch"},
                             files={"file": ("v.jsonl", jsonl(3) + line(9), "application/jsonl")})
            victim[fk] = r.json()["id"]
            r = await c.post("/v1/batches", headers=auth(KEYS["beta"]), json={
                "input_file_id": victim[fk], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            victim[bk] = r.json()["id"]
            if bk == "victim_running":
                await svc._maintain(time.time())  # one lane step: this one is in progress with its lines
        w = World(c, svc, victim, admin_key)
        jobs, *_ = await w.snapshot()
        assert [j["status"] for j in jobs] == ["validating", "in_progress"]
        return c, w

    client, world = loop.run_until_complete(setup())
    try:
        before = loop.run_until_complete(world.snapshot())

        @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.lists(st.tuples(st.sampled_from(sorted(ATTACKERS)), ACTIONS), max_size=10))
        def calls_leave_the_victim_alone(seq: list[tuple[str, tuple[str, Any]]]) -> None:
            async def run() -> None:
                for who, action in seq:
                    await world.act(who, action)
                assert await world.snapshot() == before
            loop.run_until_complete(run())

        calls_leave_the_victim_alone()
    finally:
        async def close() -> None:
            await client.aclose()
            await gw.close()
            await svc.store.close()
        loop.run_until_complete(close())
        loop.close()
