"""`gateway serve` with `server.workers: 2` end to end: the real supervisor and two real worker processes on one
port, in front of the test upstream, budgets on the real Redis (and, on the default config, on the SQLite store
the workers share).

Pins: connections reach both workers; a `requests` budget is exact across them (Redis); SIGHUP reloads every
worker; a worker killed with SIGKILL is restarted while a stream on the other one runs to [DONE]; a rolling
restart (SIGUSR2) replaces every worker without one failed request; SIGTERM drains the streams in flight and
exits 0 with the port closed.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import sqlite3
import threading
import time
import uuid

import httpx
import orjson
import pytest
import redis
import yaml

from tests.conftest import require_redis
from tests.support.procs import free_port, start_gateway, start_upstream
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e
KEY = "workers-e2e-key-0123456789"
CAPPED = "workers-capped-key-0123456789"
CAP = 12
TOKENS = "workers-tokens-key-0123456789"
TOKEN_LIMIT = 400  # tokens a day for tenant `tokens`: a handful of requests' worst case


def write_config(tmp, port, up_port, prefix, models=("up-model",), store: str | None = "redis") -> None:
    """`store: None` leaves budgets.store out: the default (auto), which is SQLite for 2 workers."""
    budgets = {"key_prefix": prefix, "sqlite_path": str(tmp / "ledger.db"), "spool_path": str(tmp / "spool.jsonl"),
               "ledger_flush_s": 0.05, **({"store": store} if store else {})}
    cfg = {"server": {"host": "127.0.0.1", "port": port, "workers": 2, "graceful_shutdown_s": 10},
           "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                         "models": list(models), "location": {"country": "DE"}, "retention": "zero"}],
           "keys": [{"key": KEY, "tenant": "acme", "name": "k"}, {"key": CAPPED, "tenant": "capped", "name": "c"},
                    {"key": TOKENS, "tenant": "tokens", "name": "t"}],
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": budgets,
           "observability": {"log_level": "warning"}}
    (tmp / "gw.yaml").write_text(yaml.safe_dump(cfg))


POLICY = {"version": 1, "rules": [
    {"id": "capped-requests", "match": {"tenant": "capped"}, "budgets": [{"window": "day", "requests": CAP}]},
    {"id": "few-tokens", "match": {"tenant": "tokens"}, "budgets": [{"window": "day", "tokens": TOKEN_LIMIT}]}]}


@pytest.fixture()
def stack(tmp_path):
    require_redis()
    prefix = f"gwb-workers-{uuid.uuid4().hex[:10]}"
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    up, up_port = start_upstream(tmp_path)
    port = free_port()
    write_config(tmp_path, port, up_port, prefix)
    gw, _ = start_gateway(tmp_path / "gw.yaml", timeout=60)
    base = f"http://127.0.0.1:{port}"
    wait_workers(base, 2, gw=gw)
    try:
        yield {"tmp": tmp_path, "gw": gw, "base": base, "port": port, "up_port": up_port, "prefix": prefix}
    finally:
        gw.stop(30)
        up.stop()
        r = redis.Redis(host="127.0.0.1", port=6379)
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
        r.close()


def fresh(base: str, path: str, **kw) -> httpx.Response:
    """One request on a new connection (so the kernel picks a worker afresh)."""
    with httpx.Client(timeout=30) as c:
        return c.request(kw.pop("method", "GET"), base + path, **kw)


def pids(base: str, tries: int = 60) -> set[int]:
    return {fresh(base, "/healthz").json()["pid"] for _ in range(tries)}


def wait_workers(base: str, n: int, exclude: set[int] = frozenset(), timeout: float = 60.0, gw=None) -> set[int]:
    """Poll /healthz on fresh connections until `n` distinct worker pids (none in `exclude`) answered; the
    failure carries the end of `gw`'s log (a worker that died at start says why there)."""
    deadline, seen = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        try:
            seen |= {fresh(base, "/healthz").json()["pid"]} - exclude
        except httpx.HTTPError:
            pass
        if len(seen) >= n:
            return seen
        if gw is not None and not gw.alive():  # the supervisor gave up (a worker failed to start): say why now
            break
        time.sleep(0.02)
    tail = f"; gateway log:\n{gw.log()[-4000:]}" if gw is not None else ""
    raise AssertionError(f"only {seen} answered within {timeout}s{tail}")


def chat(stream: bool = False, fault: str | None = None, max_tokens: int = 4) -> dict:
    b = {"model": "up-model", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        b["stream"] = True
    if fault:
        b["x_test_fault"] = fault
    return b


class RawStream:
    """A streamed request on a raw socket: we know its local port, so we can tell which worker accepted it."""

    def __init__(self, port: int, body: dict) -> None:
        data = orjson.dumps(body)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.local_port = self.sock.getsockname()[1]
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          + f"authorization: Bearer {KEY}\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
        self.buf = bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        self.sock.settimeout(30)
        try:
            while not self.buf.endswith(b"0\r\n\r\n"):
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buf += chunk
        except OSError:
            pass

    def result(self, timeout: float = 30.0) -> bytes:
        self.thread.join(timeout)
        self.sock.close()
        return bytes(self.buf)


def accepting_pid(gw_port: int, client_port: int, candidates: set[int]) -> int:
    """The worker holding the gateway side of the client's connection (/proc/net/tcp inode -> /proc/<pid>/fd)."""
    inode = None
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split()
        local, remote = f[1], f[2]
        if int(local.split(":")[1], 16) == gw_port and int(remote.split(":")[1], 16) == client_port:
            inode = f[9]
    assert inode is not None, "the gateway side of the connection is not in /proc/net/tcp"
    for pid in candidates:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no worker of {candidates} holds socket {inode}")


def test_connections_reach_both_workers(stack):
    assert len(pids(stack["base"])) == 2


def test_a_requests_budget_is_exact_across_workers(stack):
    """40 concurrent requests on fresh connections, both workers, a budget of 12: exactly 12 are served."""
    async def go():
        async def one():
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(stack["base"] + "/v1/chat/completions", json=chat(),
                                 headers={"authorization": f"Bearer {CAPPED}"})
                return r.status_code, r.json()
        return await asyncio.gather(*(one() for _ in range(40)))

    out = asyncio.run(go())
    codes = sorted(c for c, _ in out)
    assert codes.count(200) == CAP and codes.count(429) == 40 - CAP, codes
    refused = [b for c, b in out if c == 429]
    assert all(b["error"]["code"] == "rate_limit_exceeded" and "requests limit of 12" in b["error"]["message"]
               for b in refused)


@pytest.fixture()
def default_stack(tmp_path):
    """Two workers on the default config: no Redis anywhere (budgets.store left out, so SQLite)."""
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    up, up_port = start_upstream(tmp_path)
    port = free_port()
    write_config(tmp_path, port, up_port, "gwb", store=None)
    gw, _ = start_gateway(tmp_path / "gw.yaml", timeout=60)
    base = f"http://127.0.0.1:{port}"
    wait_workers(base, 2, gw=gw)
    try:
        yield {"tmp": tmp_path, "gw": gw, "base": base, "port": port}
    finally:
        gw.stop(30)
        up.stop()


async def _burst(base: str, key: str, n: int, max_tokens: int = 4) -> list[tuple[int, dict]]:
    async def one():
        async with httpx.AsyncClient(timeout=30) as c:  # its own connection: the kernel picks a worker
            r = await c.post(base + "/v1/chat/completions", json=chat(max_tokens=max_tokens),
                             headers={"authorization": f"Bearer {key}"})
            return r.status_code, r.json()
    return list(await asyncio.gather(*(one() for _ in range(n))))


def test_the_default_config_runs_two_workers_with_budgets_exact_across_them(default_stack):
    """No Redis: the workers share the SQLite budget store. A requests budget of 12 under 40 concurrent requests
    serves exactly 12; a 400-token day budget under 40 concurrent requests never settles more than the limit plus
    one request's worst case (the documented bound), and the ledger has every served request."""
    base, tmp = default_stack["base"], default_stack["tmp"]
    assert len(pids(base)) == 2
    out = asyncio.run(_burst(base, CAPPED, 40))
    codes = sorted(c for c, _ in out)
    assert codes.count(200) == CAP and codes.count(429) == 40 - CAP, codes
    assert all(b["error"]["code"] == "rate_limit_exceeded" for c, b in out if c == 429)

    max_tokens = 24
    out = asyncio.run(_burst(base, TOKENS, 40, max_tokens=max_tokens))
    served = [b for c, b in out if c == 200]
    assert served and all(c in (200, 429) for c, _ in out), [c for c, _ in out]
    assert all(b["error"]["code"] == "insufficient_quota" for c, b in out if c == 429)
    used = sum(b["usage"]["total_tokens"] for b in served)
    # the worst case of one request: its prompt bound (chars + 16 per message + 16) plus max_tokens; two workers
    # counting apart would each admit the limit's worth
    assert used <= TOKEN_LIMIT + (2 + 32) + max_tokens, used
    db = sqlite3.connect(tmp / "ledger.db")
    try:
        deadline = time.monotonic() + 30
        while True:  # each worker's ledger writer flushes on its own (ledger_flush_s)
            n, total = db.execute("select count(*), coalesce(sum(total_tokens), 0) from budget_ledger "
                                  "where tenant='tokens'").fetchone()
            if n == len(served) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (n, total) == (len(served), used)
    finally:
        db.close()
    # one counter set for the host, in the SQLite store beside the ledger (not two in-process ones)
    counters = sqlite3.connect(tmp / "ledger-counters.db")
    try:
        assert counters.execute("select count(*) from budget_counters where k like 'gwb:tenant:tokens:%'").fetchone()[0]
    finally:
        counters.close()


def test_sighup_reloads_every_worker(stack):
    """After SIGHUP, 30 requests in a row on fresh connections (both workers) all list the new model."""
    write_config(stack["tmp"], stack["port"], stack["up_port"], stack["prefix"], models=("up-model", "up-model-2"))
    stack["gw"].signal(signal.SIGHUP)
    deadline, streak = time.monotonic() + 30, 0
    while streak < 30:
        assert time.monotonic() < deadline, "not every worker reloaded within 30 s"
        r = fresh(stack["base"], "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        streak = streak + 1 if "up-model-2" in {m["id"] for m in r.json()["data"]} else 0
        if not streak:
            time.sleep(0.05)
    assert len(pids(stack["base"])) == 2  # reloaded in place, not restarted


def test_a_killed_worker_is_restarted_and_the_other_ones_stream_finishes(stack):
    before = pids(stack["base"])
    s = RawStream(stack["port"], chat(stream=True, fault="slow_chunks:0.15", max_tokens=12))
    wait_until(lambda: b'"content"' in s.buf, what="the stream's first token")
    serving = accepting_pid(stack["port"], s.local_port, before)
    victim = (before - {serving}).pop()
    env = dict(kv.split("=", 1) for kv in open(f"/proc/{victim}/environ").read().split("\0") if "=" in kv)
    metrics_dir = env["PROMETHEUS_MULTIPROC_DIR"]
    assert [f for f in os.listdir(metrics_dir) if f.startswith("gauge_live") and f.endswith(f"_{victim}.db")]
    os.kill(victim, signal.SIGKILL)
    out = s.result()
    assert out.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in out, out[-300:]
    assert out.count(b'"content"') >= 12
    after = wait_workers(stack["base"], 1, exclude=before)  # the replacement answers
    assert victim not in after
    assert len(pids(stack["base"])) == 2 and stack["gw"].alive()
    assert "worker" in stack["gw"].log() and "restarting" in stack["gw"].log()
    # the dead worker's live gauges (in-flight requests) left the merged /metrics with it
    assert not [f for f in os.listdir(metrics_dir) if f.startswith("gauge_live") and f.endswith(f"_{victim}.db")]


def test_rolling_restart_replaces_every_worker_without_a_failed_request(stack):
    before = pids(stack["base"])
    errors: list[str] = []
    served = [0]
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                r = fresh(stack["base"], "/v1/chat/completions", method="POST", json=chat(),
                          headers={"authorization": f"Bearer {KEY}"})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                served[0] += 1
            except httpx.HTTPError as e:
                errors.append(repr(e))

    t = threading.Thread(target=load)
    t.start()
    try:
        stack["gw"].signal(signal.SIGUSR2)
        new = wait_workers(stack["base"], 2, exclude=before, timeout=90)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pids(stack["base"], 20) & before:
            time.sleep(0.2)  # the old workers drain and exit
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(30)
    assert pids(stack["base"]) == new
    assert errors == [] and served[0] > 20, (errors[:5], served[0])


def test_sigterm_drains_streams_on_every_worker_and_exits_0(stack):
    streams = [RawStream(stack["port"], chat(stream=True, fault="slow_chunks:0.1", max_tokens=15)) for _ in range(4)]
    wait_until(lambda: all(b'"content"' in s.buf for s in streams), what="a first token on each of the 4 streams")
    stack["gw"].signal(signal.SIGTERM)
    for s in streams:
        out = s.result()
        assert out.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in out, out[-300:]
    assert stack["gw"].p.wait(30) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", stack["port"]), timeout=1).close()


def test_metrics_on_any_worker_count_every_workers_requests(stack):
    """30 requests spread over both workers: each scrape, whichever worker answers, counts all 30."""
    for _ in range(30):
        r = fresh(stack["base"], "/v1/chat/completions", method="POST", json=chat(),
                  headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
    assert len(pids(stack["base"])) == 2
    for _ in range(8):
        text = fresh(stack["base"], "/metrics").text
        total = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                    if ln.startswith("gateway_requests_total{") and 'model="up-model"' in ln)
        assert total == 30, [ln for ln in text.splitlines() if ln.startswith("gateway_requests_total")]
        assert "gen_ai_server_time_to_first_token_seconds" in text or "gen_ai_client_operation_duration" in text


def test_every_worker_subscribes_to_the_engines_kv_events(tmp_path):
    """vLLM publishes KV events on a PUB socket: each worker subscribes itself, so every worker's index holds
    the blocks of requests the other worker dispatched; and each worker hears the other on the peer bus."""
    from backends.sim.fleet import FleetProcess

    require_redis()
    fleet = FleetProcess(["--engines", "1", "--profile", "vllm-default", "--base-port", "0"], tmp_path / "fleet.json")
    man = fleet.start()
    port, admin = free_port(), "workers-e2e-admin-0123456789"
    e = man["engines"][0]
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": port, "workers": 2},
        "backends": [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                      "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                      "location": {"country": "DE"}}],
        "keys": [{"key": KEY, "tenant": "acme"}], "admin": {"key": admin},
        "identity": {"sqlite_path": str(tmp_path / "id.db")}, "policy": {"audit_path": str(tmp_path / "a.jsonl")},
        "budgets": {"store": "redis", "key_prefix": f"gwb-workers-{uuid.uuid4().hex[:8]}",
                    "sqlite_path": str(tmp_path / "l.db"), "spool_path": str(tmp_path / "s.jsonl")},
        "observability": {"log_level": "warning"}}))
    gw, _ = start_gateway(tmp_path / "gw.yaml", timeout=60)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_workers(base, 2, gw=gw)
        for i in range(6):
            r = fresh(base, "/v1/chat/completions", method="POST", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "sim-model", "max_tokens": 2,
                            "messages": [{"role": "user", "content": f"request {i} " + "word " * 300}]})
            assert r.status_code == 200, r.text
        def engine() -> dict:
            snap = fresh(base, "/admin/fleet", headers={"authorization": f"Bearer {admin}"}).json()
            return snap["engines"]["engines"][e["name"]]

        deadline = time.monotonic() + 20
        while not engine()["cached_blocks"]:
            assert time.monotonic() < deadline, "no worker indexed the engine's blocks"
            time.sleep(0.1)
        time.sleep(0.5)
        # 30 fresh scrapes in a row, whichever worker answers: each has the blocks
        for _ in range(30):
            eng = engine()
            assert eng["cached_blocks"] and eng["kv_events"]["last_seq"] is not None, eng
        # and the workers route as one: each hears the other on the peer bus (Redis, the budgets' store)
        for _ in range(10):
            peers = fresh(base, "/admin/routing", headers={"authorization": f"Bearer {admin}"}).json()["peers"]
            assert peers["transport"] == "redis" and len(peers["peers"]) == 1, peers
            assert all(p["last_heard_s"] < 3 for p in peers["peers"].values()), peers
    finally:
        gw.stop(30)
        fleet.stop()


def test_workers_do_not_outlive_a_killed_supervisor(stack):
    """kill -9 of the supervisor: its workers get SIGTERM (PR_SET_PDEATHSIG), drain and exit; none is orphaned."""
    workers = pids(stack["base"])
    stack["gw"].p.send_signal(signal.SIGKILL)  # the supervisor only: workers are in their own process group
    stack["gw"].p.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "a worker outlived its supervisor"


def test_a_refused_reload_keeps_every_worker_serving_the_old_config(stack):
    """SIGHUP with a config that does not load: each worker says why and keeps serving what it had."""
    (stack["tmp"] / "gw.yaml").write_text("server: {port: [not, a, port]}\n")
    stack["gw"].signal(signal.SIGHUP)
    wait_until(lambda: stack["gw"].log().count("reload refused") >= 2, what="both workers refusing the reload")
    for _ in range(20):
        r = fresh(stack["base"], "/v1/chat/completions", method="POST", json=chat(),
                  headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
    assert len(pids(stack["base"])) == 2
    assert stack["gw"].log().count("reload refused") == 2  # one line per worker
