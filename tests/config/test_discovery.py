"""gateway/discovery.py: DNS names expand into one backend per address, refreshed; the resolver is the real one."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway import discovery
from gateway.config import ConfigError, load_config, parse_config

TEMPLATE = """
backends:
  - name: eng
    kind: vllm
    url: http://eng-headless.llm.svc.cluster.local:8000/v1
    kv_events: tcp://eng-headless.llm.svc.cluster.local:5557
    replay: tcp://eng-headless.llm.svc.cluster.local:5558
    metrics: http://eng-headless.llm.svc.cluster.local:8000/metrics
    models: [m]
    location: {country: DE}
    retention: zero
    discovery: {dns: %s, port: 8100, refresh_s: 0.5}
  - name: static
    url: http://127.0.0.1:9/v1
    models: [other]
"""


@pytest.fixture(autouse=True)
def _clean():
    discovery.ADDRESSES.clear()
    yield
    discovery.ADDRESSES.clear()


def test_the_real_resolver_finds_localhost_and_nothing_for_an_unknown_name():
    assert discovery.resolve_a("localhost") == ("127.0.0.1",)
    assert discovery.resolve_a("no-such-host.invalid") == ()


async def test_the_async_resolver_agrees():
    assert await discovery.resolve_a_async("localhost") == ("127.0.0.1",)
    assert await discovery.resolve_a_async("no-such-host.invalid") == ()


def test_a_template_expands_into_one_backend_per_address_with_its_endpoints_and_declarations():
    cfg = parse_config(TEMPLATE % "eng.test")
    assert [b.name for b in cfg.backends] == ["static"] and cfg.models["m"] == ()  # nothing resolved yet
    discovery.ADDRESSES["eng.test"] = ("10.0.0.5", "10.0.0.6")
    cfg = parse_config(TEMPLATE % "eng.test")
    eng = [b for b in cfg.backends if b.name.startswith("eng-")]
    assert [b.name for b in eng] == ["eng-10-0-0-5", "eng-10-0-0-6"]
    assert eng[0].url == "http://10.0.0.5:8100/v1"  # discovery.port replaces the url's
    assert (eng[0].kv_events, eng[0].replay, eng[0].metrics) == \
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "http://10.0.0.5:8000/metrics")
    assert all(b.location.country == "DE" and b.retention == "zero" and b.discovery is None for b in eng)
    assert cfg.models == {"m": ("eng-10-0-0-5", "eng-10-0-0-6"), "other": ("static",)}


@pytest.mark.parametrize("bad,key", [("{dns: '', refresh_s: 1}", "discovery.dns"),
                                     ("{dns: x, refresh_s: 0}", "discovery.refresh_s"),
                                     ("{dns: x, port: 70000}", "discovery.port")])
def test_bad_discovery_values_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(f"backends:\n  - {{name: e, url: 'http://x:1/v1', models: [m], discovery: {bad}}}\n")


class _Gw:
    """What DiscoveryService needs of a Gateway: the config and reload() (which re-reads the file)."""

    def __init__(self, path: Path):
        self.config = load_config(path)
        self.reloads = 0

    async def reload(self):
        self.reloads += 1
        self.config = load_config(self.config.path)
        return self.config


async def test_a_changed_address_set_reloads_and_a_vanished_name_keeps_its_last_addresses(tmp_path):
    p = tmp_path / "gateway.yaml"
    p.write_text(TEMPLATE % "eng.test")
    answers = {"eng.test": ("10.0.0.5",)}

    async def resolver(name: str):
        return answers.get(name, ())

    gw = _Gw(p)
    svc = discovery.DiscoveryService(gw, resolver=resolver, clock=lambda: 0.0)
    assert await svc.refresh(force=True) and gw.reloads == 1
    assert [b.name for b in gw.config.backends] == ["eng-10-0-0-5", "static"]
    assert not await svc.refresh(force=True)  # same set: no reload
    answers["eng.test"] = ("10.0.0.5", "10.0.0.7")  # a replica scaled up
    assert await svc.refresh(force=True) and gw.reloads == 2
    assert gw.config.models["m"] == ("eng-10-0-0-5", "eng-10-0-0-7")
    answers.clear()  # DNS outage: the circuits judge the engines, not the resolver
    assert not await svc.refresh(force=True)
    assert gw.config.models["m"] == ("eng-10-0-0-5", "eng-10-0-0-7")


async def test_names_are_resolved_only_when_due(tmp_path):
    p = tmp_path / "gateway.yaml"
    p.write_text(TEMPLATE % "eng.test")
    now = {"t": 0.0}
    seen: list[str] = []

    async def resolver(name: str):
        seen.append(name)
        return ("10.0.0.5",)

    svc = discovery.DiscoveryService(_Gw(p), resolver=resolver, clock=lambda: now["t"])
    await svc.refresh()
    await svc.refresh()
    assert seen == ["eng.test"]
    now["t"] = 0.6  # past refresh_s
    await svc.refresh()
    assert seen == ["eng.test", "eng.test"]


def test_config_check_says_what_each_discovery_name_resolves_to(tmp_path, capsys):
    from gateway.cli import main

    p = tmp_path / "gateway.yaml"
    p.write_text(TEMPLATE % "localhost" + """  - name: nowhere
    url: http://x.invalid:1/v1
    models: [m]
    discovery: {dns: no-such-host.invalid}
""")
    assert main(["config", "check", str(p)]) == 0
    out = capsys.readouterr().out
    assert "discovery: eng: localhost -> eng-127-0-0-1" in out
    assert "discovery: nowhere: no-such-host.invalid -> no address yet" in out
