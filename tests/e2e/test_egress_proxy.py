"""Partner routes behind an egress proxy, per backend opt-in: a real `python -m gateway serve` in front of three
upstreams, with a real forward proxy (tests/support/fwdproxy.py) that logs every request it carries.
`trust_env: true` honours HTTP(S)_PROXY and NO_PROXY from the gateway's environment, `proxy: <url>` names
one; a backend without either never goes through the proxy, whatever the environment says (engines on the
cluster network must not). An https:// partner goes through HTTPS_PROXY as a CONNECT tunnel."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
import sys
import time

import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.procs import Proc, free_port, start_gateway, start_upstream, wait_http

TLS_PROBE_TIMEOUT_S = 20.0

pytestmark = pytest.mark.e2e
KEY = "egress-key-0123456789"


def proxy_env(proxy: str, no_proxy: str = "") -> dict[str, str]:
    env = {}
    for name, value in (("http_proxy", proxy), ("https_proxy", proxy), ("all_proxy", ""), ("no_proxy", no_proxy)):
        env[name] = env[name.upper()] = value
    return env


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("egress")
    ups = {name: start_upstream(tmp) for name in ("direct", "env", "explicit")}
    pport = free_port()
    plog = tmp / "proxy.log"
    plog.write_text("")
    proxy = Proc([sys.executable, "-m", "tests.support.fwdproxy", str(pport), str(plog)], tmp / "fwdproxy.out")
    deadline = time.monotonic() + 10
    while True:  # the proxy answers a CONNECT to nowhere with 502 once it listens
        try:
            httpx.get("http://127.0.0.1:1/", proxy=f"http://127.0.0.1:{pport}", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    yield {"tmp": tmp, "ups": {n: p for n, (_, p) in ups.items()}, "proxy": f"http://127.0.0.1:{pport}",
           "log": plog}
    proxy.stop()
    for p, _ in ups.values():
        p.stop()


def gateway(setup, name: str, env: dict[str, str]):
    ups = setup["ups"]
    port = free_port()
    backends = [
        {"name": "direct", "url": f"http://127.0.0.1:{ups['direct']}/v1", "models": ["direct-model"]},
        {"name": "env", "url": f"http://127.0.0.1:{ups['env']}/v1", "models": ["env-model"], "trust_env": True,
         "operator": "partner"},
        {"name": "explicit", "url": f"http://127.0.0.1:{ups['explicit']}/v1", "models": ["explicit-model"],
         "proxy": setup["proxy"], "operator": "partner"},
    ]
    for b in backends:
        b.update({"location": {"country": "DE"}, "retention": "zero", "health": {"interval_s": 0.3}})
    cfg = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
           "keys": [{"key": KEY, "tenant": "t", "name": "k"}],
           "policy": {"audit_path": str(setup["tmp"] / f"audit-{name}.jsonl"), "files": []},
           "identity": {"sqlite_path": str(setup["tmp"] / f"id-{name}.db")},
           "budgets": {"sqlite_path": str(setup["tmp"] / f"b-{name}.db")}}
    path = setup["tmp"] / f"gw-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_gateway(path, env=env)


def chat(port: int, model: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                      timeout=10)


def proxied_ports(setup) -> set[int]:
    """Upstream ports the proxy carried a request to (absolute-form targets and CONNECT authorities)."""
    out = set()
    for line in setup["log"].read_text().splitlines():
        target = line.split(" ", 1)[1]
        hostport = target.split("://", 1)[-1].split("/", 1)[0]
        out.add(int(hostport.rsplit(":", 1)[1]))
    return out


def test_only_opted_in_backends_go_through_the_proxy(setup):
    setup["log"].write_text("")
    g, port = gateway(setup, "env", proxy_env(setup["proxy"]))
    try:
        for model in ("direct-model", "env-model", "explicit-model"):
            r = chat(port, model)
            assert r.status_code == 200, (model, r.text)
        ups = setup["ups"]
        lines = setup["log"].read_text().splitlines()
        assert f"POST http://127.0.0.1:{ups['env']}/v1/chat/completions" in lines
        assert f"POST http://127.0.0.1:{ups['explicit']}/v1/chat/completions" in lines
        assert ups["direct"] not in proxied_ports(setup)  # HTTP_PROXY is set, but this backend did not opt in
        # health probes of the proxied backends take the same path (else a partner reachable only through the
        # proxy would be probed directly and marked down)
        wait_http(f"http://127.0.0.1:{port}/healthz")
        deadline = time.monotonic() + 10
        while f"GET http://127.0.0.1:{ups['env']}/health" not in setup["log"].read_text().splitlines():
            assert time.monotonic() < deadline, setup["log"].read_text()
            time.sleep(0.1)
    finally:
        g.stop()


def test_no_proxy_is_honoured_and_an_explicit_proxy_ignores_the_environment(setup):
    setup["log"].write_text("")
    g, port = gateway(setup, "noproxy", proxy_env(setup["proxy"], no_proxy="127.0.0.1"))
    try:
        for model in ("env-model", "explicit-model"):
            r = chat(port, model)
            assert r.status_code == 200, (model, r.text)
        ports = proxied_ports(setup)
        assert setup["ups"]["env"] not in ports  # NO_PROXY names the host: direct
        assert setup["ups"]["explicit"] in ports  # `proxy:` is used as configured
    finally:
        g.stop()


def test_a_dead_proxy_fails_the_opted_in_route_only(setup):
    g, port = gateway(setup, "dead", proxy_env(f"http://127.0.0.1:{free_port()}"))
    try:
        assert chat(port, "direct-model").status_code == 200
        r = chat(port, "env-model")
        assert r.status_code in (502, 503) and r.json()["error"]["code"], r.text  # OpenAI-shaped, not a hang
    finally:
        g.stop()


def self_signed(tmp) -> tuple[str, str]:
    """A certificate for 127.0.0.1 (its own issuer) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cpath, kpath = tmp / "tls.crt", tmp / "tls.key"
    cpath.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kpath.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
    return str(cpath), str(kpath)


def test_https_partner_is_tunnelled_with_connect_through_https_proxy(setup, tmp_path):
    """An https:// partner with trust_env: HTTPS_PROXY carries it as a CONNECT tunnel; SSL_CERT_FILE (read
    under trust_env too) is how the gateway trusts the partner's certificate here."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    tls = Proc([sys.executable, "-m", "tests.support.upstream", "--port", str(port), "--tls-cert", cert,
                "--tls-key", key], tmp_path / "tls-upstream.log")
    try:
        _wait_tls(port, cert)
        gport = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": gport},
               "backends": [{"name": "tls", "url": f"https://127.0.0.1:{port}/v1", "models": ["tls-model"],
                             "trust_env": True, "operator": "partner", "location": {"country": "DE"},
                             "retention": "zero"}],
               "keys": [{"key": KEY, "tenant": "t", "name": "k"}],
               "policy": {"audit_path": str(tmp_path / "audit.jsonl"), "files": []},
               "identity": {"sqlite_path": str(tmp_path / "id.db")},
               "budgets": {"sqlite_path": str(tmp_path / "b.db")}}
        path = tmp_path / "gw-tls.yaml"
        path.write_text(yaml.safe_dump(cfg))
        setup["log"].write_text("")
        env = {**proxy_env(setup["proxy"]), "SSL_CERT_FILE": cert}
        env["http_proxy"] = env["HTTP_PROXY"] = ""  # only HTTPS_PROXY: the https:// route must use it
        g, _ = start_gateway(path, env=env)
        try:
            r = chat(gport, "tls-model")
            assert r.status_code == 200, r.text
            assert f"CONNECT 127.0.0.1:{port}" in setup["log"].read_text().splitlines()
        finally:
            g.stop()
    finally:
        tls.stop()


def _wait_tls(port: int, cert: str) -> None:
    deadline = time.monotonic() + TLS_PROBE_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"https://127.0.0.1:{port}/health", verify=ssl.create_default_context(cafile=cert),
                         timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the TLS upstream did not start"
        time.sleep(0.1)
