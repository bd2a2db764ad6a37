"""The chart's monitoring: the PrometheusRule alerts docs/operations.md lists and the Grafana dashboard, both
querying only metrics the gateway really exports (names and the labels they aggregate by)."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.charts.conftest import CHART, ROOT
from tests.charts.test_chart import K8S_VERSION, docs, one, render

DASHBOARD = CHART / "dashboards" / "gateway-overview.json"
# from other exporters, named in the rule's annotations
FOREIGN = {"kube_deployment_status_replicas_available": {"namespace", "deployment"}}
SCRAPE_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "rate", "increase", "histogram_quantile", "clamp_min", "le",
                "without", "count", "label_values", "humanize", "humanizePercentage"}


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str] | None]:
    """Metric sample names the gateway exports -> their label names (None where a custom collector's labels are
    not introspectable: then only the name is checked), from a wired gateway with a vLLM backend."""
    from gateway.app import Gateway
    from gateway.config import parse_config
    from gateway.wiring import wire

    cfg = parse_config("""
backends:
  - {name: e, kind: vllm, url: "http://127.0.0.1:9/v1", kv_events: "tcp://127.0.0.1:9", replay: "tcp://127.0.0.1:8",
     metrics: "http://127.0.0.1:9/metrics", models: [m], location: {country: DE}}
""")
    gw = Gateway(cfg)
    wire(gw)
    out: dict[str, set[str] | None] = {}
    for c in list(gw.metrics.registry._collector_to_names):
        name, labels = getattr(c, "_name", None), getattr(c, "_labelnames", None)
        if name:
            for suffix in ("", "_total", "_bucket", "_sum", "_count"):
                out[name + suffix] = set(labels) | ({"le"} if suffix == "_bucket" else set())
    for fam in gw.metrics.registry.collect():
        for s in fam.samples:
            out.setdefault(s.name, set(s.labels) or None)
        out.setdefault(fam.name, None)
        if fam.type == "counter":  # a counter family with no sample yet (no engine served) still exports _total
            out.setdefault(fam.name + "_total", None)
    return out


def _check_expr(expr: str, exported: dict[str, set[str] | None]) -> None:
    by = {lab.strip() for grp in re.findall(r"by \(([^)]*)\)", expr) for lab in grp.split(",")}
    selected = set(re.findall(r"([a-z_]+)=~?\"", expr))
    # semconv label names (gen_ai_request_model, ...) share the gen_ai_ prefix: a name used as a label is none
    names = set(re.findall(r"\b((?:gateway|gen_ai|kube)_[a-z_]+)\b", expr)) - by - selected
    assert names, expr
    for n in names:
        assert n in exported or n in FOREIGN, f"{n} is not a metric the gateway exports: {expr}"
    for n in names:
        known = FOREIGN.get(n) or exported.get(n)
        if known is not None:
            for lab in (by | selected) - SCRAPE_LABELS:
                if any(lab in (FOREIGN.get(m) or exported.get(m) or {lab}) for m in names):
                    continue
                pytest.fail(f"label {lab!r} of {expr!r} is on none of {sorted(names)}")


@pytest.fixture(scope="module")
def rendered(helm: str) -> list[dict[str, Any]]:
    return docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml")).stdout)


def test_alerts_are_the_ones_operations_md_lists_and_query_real_metrics(rendered, exported):
    rule = one(rendered, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    ops = (ROOT / "docs" / "operations.md").read_text()
    for r in rules:
        assert r["alert"] in ops, f"{r['alert']} is not documented in docs/operations.md"
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert 'namespace="llm"' in r["expr"], r["expr"]  # scoped to the release
        _check_expr(r["expr"], exported)
        assert "{{" not in r["expr"]
    names = {r["alert"] for r in rules}
    assert {"GatewayBudgetStoreUnavailable", "GatewayNotReady", "GatewayBackendCircuitOpen",
            "GatewayKvIndexStale"} <= names  # the prose list: budget store, readiness on all pods, circuits, KV
    circuit = next(r for r in rules if r["alert"] == "GatewayBackendCircuitOpen")
    assert "{{ $labels.backend }}" in circuit["annotations"]["summary"]  # Prometheus' template, not Helm's


def test_the_rule_is_off_by_default(helm: str):
    kinds = {o["kind"] for o in docs(render(helm).stdout)}
    assert "PrometheusRule" not in kinds
    assert not [o for o in docs(render(helm).stdout) if o["metadata"]["name"].endswith("-dashboard")]


def test_the_dashboard_ships_in_a_configmap_and_queries_real_metrics(rendered, exported, kval):
    cm = one(rendered, "ConfigMap", "gw-gateway-dashboard")
    kval.validate(cm, K8S_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["gateway-overview.json"])
    assert dash == json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 12
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        for t in p["targets"]:
            assert 'namespace="$namespace"' in t["expr"]
            _check_expr(t["expr"], exported)


def test_a_query_on_a_missing_metric_is_caught(exported):
    with pytest.raises(AssertionError):
        _check_expr('sum(rate(gateway_no_such_metric_total{namespace="x"}[5m]))', exported)
    with pytest.raises(pytest.fail.Exception):
        _check_expr('sum by (no_such_label) (rate(gateway_requests_total{namespace="x"}[5m]))', exported)
