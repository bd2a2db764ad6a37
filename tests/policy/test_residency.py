"""Residency and retention are filters: property tests over random configs, policies and fault sequences."""
from __future__ import annotations

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.config import BackendConfig, Location
from gateway.errors import GatewayError
from gateway.policy.compiler import PolicyError, compile_text
from gateway.policy.eea import EEA_COUNTRIES
from gateway.policy.model import RequestAttrs
from gateway.policy.residency import backend_allowed, filter_backends
from gateway.types import Decision, Principal

COUNTRIES = ["DE", "FR", "NL", "SE", "NO", "IS", "US", "GB", "CH", "JP", "IE", "PL"]


@st.composite
def backends(draw):
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        loc = None
        if draw(st.booleans()) or draw(st.booleans()):
            c = draw(st.sampled_from(COUNTRIES))
            sc = draw(st.one_of(st.none(), st.sampled_from(COUNTRIES)))
            loc = Location(country=c, storage_country=sc)
        ret = draw(st.sampled_from(["zero", "none", "30d", "0d"]))
        out.append(BackendConfig(name=f"b{i}", url=f"http://b{i}", models=["m"], location=loc, retention=ret,
                                 operator=draw(st.sampled_from(["self", "partner"]))))
    return out


def jurisdictions():
    return st.one_of(st.just("EEA"), st.just("EU"), st.lists(st.sampled_from(COUNTRIES), min_size=1, max_size=4, unique=True))


@st.composite
def policies(draw):
    rules = []
    for i in range(draw(st.integers(0, 6))):
        match = draw(st.sampled_from([{}, {"labels.residency": "eea"}, {"team": "t1"}, {"partner": "opper"},
                                      {"headers": {"x-data-classification": "confidential"}}, {"model": "m*"}]))
        req = {}
        if draw(st.booleans()):
            req["jurisdiction"] = draw(jurisdictions())
        if draw(st.booleans()):
            req["retention"] = "zero"
        rule = {"id": f"r{i}", "match": match}
        if req:
            rule["require"] = req
        rules.append(rule)
    # the contract rules every generated policy also carries
    rules.append({"id": "eea-label", "match": {"labels.residency": "eea"}, "require": {"jurisdiction": "EEA"}})
    rules.append({"id": "opper", "match": {"partner": "opper"}, "require": {"jurisdiction": "EEA", "retention": "zero"}})
    return yaml.safe_dump({"rules": rules})


principals = st.builds(
    lambda team, partner, eea: Principal(id="p", kind="api_key", tenant="acme", team=team, partner=partner,
                                         labels={"residency": "eea"} if eea else {}),
    st.sampled_from([None, "t1", "t2"]), st.sampled_from([None, "opper"]), st.booleans())


def oracle_ok(d: Decision, b: BackendConfig) -> bool:
    """Independent statement of the invariant (not the code under test)."""
    if d.allowed_countries is not None:
        if b.location is None:
            return False
        if b.location.country not in d.allowed_countries:
            return False
        if (b.location.storage_country or b.location.country) not in d.allowed_countries:
            return False
    if d.retention == "zero" and b.retention != "zero":
        return False
    return True


def route(decision: Decision, bks: list[BackendConfig], faults: list[bool], max_attempts: int) -> list[str]:
    """A retrying/falling-back dispatcher over the filtered candidate list; returns backends contacted."""
    contacted: list[str] = []
    for attempt in range(max_attempts):
        cands, _ = filter_backends(decision, bks)  # re-filtered on every retry and fallback
        if not cands:
            raise GatewayError(503, f"no backend satisfies residency rule {decision.residency_rule}")
        b = cands[attempt % len(cands)]
        contacted.append(b.name)
        assert oracle_ok(decision, b)
        if not faults[attempt % len(faults)]:
            return contacted
    return contacted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bks=backends(), text=policies(), p=principals, confidential=st.booleans(),
       faults=st.lists(st.booleans(), min_size=1, max_size=6), attempts=st.integers(1, 5))
def test_no_request_ever_reaches_a_backend_outside_its_decision(bks, text, p, confidential, faults, attempts):
    try:
        pol = compile_text(text)
    except PolicyError:
        assume(False)  # statically contradictory policies are rejected by the compiler (tested elsewhere)
        return
    headers = {"x-data-classification": "confidential"} if confidential else {}
    d = pol.decide(p, RequestAttrs(model="m1", headers=headers))
    if not d.allow:
        assert d.reason  # contradictory residency is a named deny, never a silent send
        return
    # contracts hold: the eea label and partner opper always constrain to (a subset of) the EEA
    if p.partner == "opper" or p.labels.get("residency") == "eea":
        assert d.allowed_countries is not None and d.allowed_countries <= EEA_COUNTRIES
    if p.partner == "opper":
        assert d.retention == "zero"
    try:
        contacted = route(d, bks, faults, attempts)
    except GatewayError as e:
        assert e.status in (403, 503) and not any(oracle_ok(d, b) for b in bks)
        return
    for name in contacted:
        assert oracle_ok(d, next(b for b in bks if b.name == name))


@settings(max_examples=300, deadline=None)
@given(bks=backends(), countries=st.one_of(st.none(), st.frozensets(st.sampled_from(COUNTRIES), max_size=5)),
       zero=st.booleans())
def test_backend_allowed_agrees_with_the_invariant(bks, countries, zero):
    d = Decision(allowed_countries=countries, retention="zero" if zero else None, residency_rule="r")
    for b in bks:
        why = backend_allowed(d, b)
        assert (why is None) == oracle_ok(d, b)
        if why is not None:
            assert why.startswith(("residency:", "retention:"))


def test_reasons_are_specific():
    d = Decision(allowed_countries=EEA_COUNTRIES, jurisdiction="EEA", residency_rule="opper", retention="zero",
                 retention_rule="opper")
    mk = lambda **kw: BackendConfig(name="b", url="http://b", models=["m"], **kw)  # noqa: E731
    assert "no location" in backend_allowed(d, mk(retention="zero"))
    assert "inference in US" in backend_allowed(d, mk(location=Location(country="US"), retention="zero"))
    assert "storage in US" in backend_allowed(d, mk(location=Location(country="DE", storage_country="US"), retention="zero"))
    assert "(rule opper)" in backend_allowed(d, mk(location=Location(country="DE"), retention="30d"))
    assert backend_allowed(d, mk(location=Location(country="NO"), retention="zero")) is None
    assert backend_allowed(Decision(), mk()) is None  # no requirement: anything goes


def test_a_refusal_names_what_is_required_and_the_rule() -> None:
    """The refusal's text (built only for a refusal): the jurisdiction, else the allowed countries sorted, and
    the rule; an allowed backend gets None."""
    d = Decision(allow=True, allowed_countries=frozenset({"SE", "DE"}), residency_rule="eu-only")
    b = lambda loc: BackendConfig(name="b", url="http://b", models=["m"], location=loc, retention="zero")  # noqa: E731
    assert backend_allowed(d, b(Location(country="DE"))) is None
    assert backend_allowed(d, b(None)) == "residency: backend declares no location; DE,SE required (rule eu-only)"
    assert backend_allowed(d, b(Location(country="US"))) == "residency: inference in US, DE,SE required (rule eu-only)"
    assert backend_allowed(d, b(Location(country="DE", storage_country="US"))) == \
        "residency: storage in US, DE,SE required (rule eu-only)"
    eea = Decision(allow=True, allowed_countries=frozenset({"DE"}), jurisdiction="EEA")
    assert backend_allowed(eea, b(Location(country="US"))) == "residency: inference in US, EEA required"
