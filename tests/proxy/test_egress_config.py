"""Egress-proxy opt-in per backend: config validation and the client a backend gets (httpx with the proxy
settings when opted in, the configured client otherwise). The proxy itself: tests/e2e/test_egress_proxy.py."""
from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.proxy.h1client import H1Transport
from gateway.proxy.transport import HttpxTransport
from gateway.proxy.upstream import Upstreams

BASE = """
backends:
  - {name: engine, url: "http://127.0.0.1:9/v1", models: [m]}
  - {name: partner, url: "https://partner.example/v1", models: [m], %s}
"""


async def test_opted_in_backends_get_httpx_with_the_proxy_settings_and_others_keep_the_native_client():
    for opt in ("trust_env: true", "proxy: 'http://egress:3128'"):
        cfg = parse_config(BASE % opt)
        up = Upstreams(cfg)
        try:
            assert isinstance(up.client("engine"), H1Transport)
            assert isinstance(up.client("partner"), HttpxTransport)
            assert up.probe_client(cfg.backend("engine")) is None  # the shared, proxy-free probe client
            assert up.probe_client(cfg.backend("partner")) is not None
        finally:
            await up.aclose()


@pytest.mark.parametrize("opt,msg", [("proxy: 'ftp://egress'", "http:// or https://"),
                                     ("proxy: 'http://egress:3128', trust_env: true", "not both")])
def test_bad_proxy_settings_are_refused(opt, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config(BASE % opt)
