"""Benchmark the authentication stage: per-request cost of each credential kind, cached and uncached.

Runs IdentityService on a temporary SQLite store with a local JWKS server; prints a table of µs/request
(median of several rounds). Usage: python bench/auth.py [--n 20000]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
import yaml
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from starlette.datastructures import Headers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway.config import parse_config  # noqa: E402
from gateway.identity.service import IdentityService  # noqa: E402
from gateway.identity.stage import AuthStage  # noqa: E402
from gateway.pipeline import RequestContext  # noqa: E402

ISS = "https://idp.bench"


def jwks_server(doc: dict[str, Any]) -> tuple[ThreadingHTTPServer, str]:
    body = json.dumps(doc).encode()

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s, f"http://127.0.0.1:{s.server_address[1]}/jwks"


async def timeit(fn: Any, n: int, rounds: int = 5) -> float:
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        res.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(res)


async def main(n: int) -> None:
    rk = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ek = ec.generate_private_key(ec.SECP256R1())
    jr = json.loads(RSAAlgorithm.to_jwk(rk.public_key())) | {"kid": "r", "alg": "RS256"}
    je = json.loads(ECAlgorithm.to_jwk(ek.public_key())) | {"kid": "e", "alg": "ES256"}
    srv, url = jwks_server({"keys": [jr, je]})
    tmp = Path(tempfile.mkdtemp())
    cfg = parse_config(yaml.safe_dump({
        "identity": {"sqlite_path": str(tmp / "id.db"), "jwt": [{"issuer": ISS, "jwks_url": url, "audience": "gw"}]},
        "keys": [{"key": "sk-bench-static-key-000000000000", "tenant": "t"}],
    }), base_dir=tmp)
    svc = IdentityService(cfg)
    await svc.start()
    await svc.directory.create_tenant("acme", labels={"residency": "eea"})
    await svc.directory.create_team("acme", "search")
    _, key = await svc.directory.create_key("acme", team="search", models=["qwen*"])
    now = int(time.time())
    claims = {"iss": ISS, "aud": "gw", "sub": "u", "exp": now + 3600, "tenant": "acme", "team": "search"}
    tok_r = jwt.encode(claims, rk, algorithm="RS256", headers={"kid": "r"})
    tok_e = jwt.encode(claims, ek, algorithm="ES256", headers={"kid": "e"})
    stage = AuthStage(svc)

    def hdr(tok: str) -> Headers:
        return Headers(raw=[(b"authorization", f"Bearer {tok}".encode()), (b"x-end-user-id", b"user-1")])

    h_key, h_static, h_r, h_e = hdr(key), hdr("sk-bench-static-key-000000000000"), hdr(tok_r), hdr(tok_e)
    for h in (h_key, h_r, h_e):
        await svc.authenticate(h, "b")  # warm caches (JWKS fetched, key loaded)

    async def stage_run() -> None:
        ctx = RequestContext(request_id="x", endpoint="chat", headers=h_key, body={}, client_addr="b",
                             model="qwen3")
        await stage.run(ctx)

    async def uncached(tok_src: Any, alg: str) -> float:
        toks = [jwt.encode(claims | {"sub": f"u{i}"}, tok_src, algorithm=alg,
                           headers={"kid": "r" if alg == "RS256" else "e"}) for i in range(n // 10)]
        it = iter(toks)
        t0 = time.perf_counter()
        for t in toks:
            await svc.authenticate(hdr(next(it)), "b")
        return (time.perf_counter() - t0) / len(toks) * 1e6

    rows = [
        ("API key (cached)  service.authenticate", await timeit(lambda: svc.authenticate(h_key, "b"), n)),
        ("API key (cached)  AuthStage.run incl. ctx", await timeit(stage_run, n)),
        ("static config key", await timeit(lambda: svc.authenticate(h_static, "b"), n)),
        ("JWT RS256 (cached verification)", await timeit(lambda: svc.authenticate(h_r, "b"), n)),
        ("JWT ES256 (cached verification)", await timeit(lambda: svc.authenticate(h_e, "b"), n)),
        ("JWT RS256 first sight (signature verify)", await uncached(rk, "RS256")),
        ("JWT ES256 first sight (signature verify)", await uncached(ek, "ES256")),
    ]
    svc._keys.clear()
    t0 = time.perf_counter()
    for _ in range(200):
        svc._keys.clear()
        await svc.authenticate(h_key, "b")
    rows.append(("API key cache miss (SQLite lookup)", (time.perf_counter() - t0) / 200 * 1e6))
    print(f"{'case':<44} {'µs/request':>11}")
    print("-" * 56)
    for name, us in rows:
        print(f"{name:<44} {us:>11.1f}")
    await svc.close()
    srv.shutdown()


async def revocation_latency(dsn: str, trials: int = 20) -> None:
    """Two services sharing Postgres (TTL 60 s): time from revoke() start until the other one refuses."""
    import secrets

    import asyncpg

    from gateway.errors import GatewayError

    schema = "bench_" + secrets.token_hex(4)
    tmp = Path(tempfile.mkdtemp())
    text = yaml.safe_dump({"identity": {"store": "postgres", "postgres_dsn": dsn, "postgres_schema": schema,
                                        "cache_ttl_s": 60}})
    a, b = (IdentityService(parse_config(text, base_dir=tmp)) for _ in range(2))
    await a.start()
    await b.start()
    await a.directory.create_tenant("acme")
    res = []
    for _ in range(trials):
        k, s = await a.directory.create_key("acme")
        h = {"authorization": f"Bearer {s}"}
        await b.authenticate(h, "r")
        t0 = time.perf_counter()
        await a.directory.revoke_key(k.id)
        while True:
            try:
                await b.authenticate(h, "r")
            except GatewayError:
                break
            await asyncio.sleep(0.0005)
        res.append((time.perf_counter() - t0) * 1e3)
    await a.close()
    await b.close()
    c = await asyncpg.connect(dsn)
    await c.execute(f'DROP SCHEMA "{schema}" CASCADE')
    await c.close()
    res.sort()
    print(f"\nrevocation across replicas (Postgres NOTIFY, {trials} trials): "
          f"p50 {statistics.median(res):.1f} ms, max {res[-1]:.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--pg", help="Postgres DSN: also measure revocation propagation between two replicas")
    a = ap.parse_args()
    asyncio.run(main(a.n))
    if a.pg:
        asyncio.run(revocation_latency(a.pg))
