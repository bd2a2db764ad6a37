"""The gateway's one config file: YAML loaded into a typed, validated, immutable snapshot.

Validation errors name the file, line and key (`gateway.yaml:12: backends[0].url: ...`). Sections owned by
subsystems live next to them (gateway/<subsystem>/config.py); this module assembles the tree and checks the
cross-references (aliases -> models, keys -> env vars, ...).
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import msgspec
import yaml

from gateway import discovery
from gateway.budget.config import BudgetsConfig
from gateway.identity.config import IdentityConfig
from gateway.policy.config import PolicyConfig
from gateway.policy.eea import country_error
from gateway.routing.config import RoutingConfig
from gateway.rollouts.config import AliasTarget, RollbackConfig, StickyConfig, alias_error
from gateway.batch.config import BatchConfig, batch_error
from gateway.cache.config import CacheConfig
from gateway.cost.config import CostConfig
from gateway.errors import ConfigError
from gateway.telemetry.config import TelemetryConfig


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 32 * 1024  # request line + headers; past it: 431 (gateway/server_protocol.py)
    max_headers: int = 256  # header count; past it: 431
    header_timeout_s: float = 10.0  # request line + headers must arrive within this (slow-loris): else 408
    body_timeout_s: float = 60.0  # the whole request body must arrive within this: else 408
    workers: int = 1  # worker processes on the one port (`gateway serve --workers N` wins); > 1 shares budgets through SQLite (or Redis) and refuses budgets.store: memory (docs/scale_out.md)
    graceful_shutdown_s: float = 20.0
    access_log: bool = False
    # uvicorn's proxy_headers/forwarded_allow_ips, read at start (the auth-failure limiter keys on the client)
    trusted_proxies: list[str] = msgspec.field(default_factory=list)  # proxy IPs/CIDRs whose X-Forwarded-For is believed; [] = none
    upstream_client: Literal["native", "aiohttp", "httpx"] = "native"  # see gateway/proxy/h1client.py and transport.py for why
    # Startup objects are always frozen out of the cyclic GC once serving (gc.freeze); raising the thresholds
    # too (e.g. [20000, 10, 10]) cuts GC time further but let RSS creep in the soak (docs/benchmarks.md, "Hot path choices")
    gc_threshold: tuple[int, int, int] | None = None  # gc.set_threshold once serving; null keeps Python's (700, 10, 10)
    # /readyz: per-model health is always in the body; only any_model / all_models let it fail readiness
    readiness: Literal["process", "any_model", "all_models"] = "process"  # process: config loaded, not draining, budget store not failing closed; any_model / all_models: also one / every model with a healthy backend


class Location(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    country: str  # ISO 3166-1 alpha-2 where inference runs
    storage_country: str | None = None  # where anything is stored (logs, caches); defaults to country
    region: str | None = None

    @property
    def storage(self) -> str:
        return self.storage_country or self.country


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    connect_s: float = 2.0
    first_token_s: float = 60.0
    idle_s: float = 30.0  # between chunks of a stream
    total_s: float = 600.0


class PoolLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_connections: int = 512
    max_keepalive: int = 128  # idle connections kept (httpx only; aiohttp keeps up to max_connections idle)
    keepalive_expiry_s: float = 30.0  # an idle upstream connection is closed after this long (both clients)


class HealthCheck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    path: str = "/health"  # relative to the server root (url without /v1)
    interval_s: float = 5.0
    failures_to_open: int = 3  # consecutive failures (passive or active) that open the circuit
    open_s: float = 5.0  # how long the circuit stays open before a half-open probe


class DnsDiscovery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One backend per address a DNS name resolves to (gateway/discovery.py), e.g. a headless Service's pods."""
    dns: str  # name whose A records are the replicas (a Kubernetes headless Service: <svc>.<ns>.svc.cluster.local)
    port: int | None = None  # port of each replica's url; null: the url's own port
    refresh_s: float = 10.0  # how often the name is resolved again; a changed address set reloads the config


class LoraPlacement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine that loads LoRA adapters at run time (vLLM --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    registered adapters of a base model it serves are loaded on it where routing sends them
    (gateway/adapters/placement.py, docs/adapters.md)."""
    dynamic: bool = False  # load registered adapters on this engine at run time
    # adapters resident at once (the engine's --max-loras); the least recently used idle one is unloaded past it;
    # unset: the engine's own, from its vllm:lora_requests_info max_lora label, else 1 (vLLM's default)
    max_loras: int | None = None
    refresh_s: float = 2.0  # how often the engine's resident adapters are read back from its /v1/models (also after a 404 for one)
    # predicted: the load time counts in the choice and the predicted TTFT (a hot adapter spreads when loading it
    # elsewhere beats waiting); ignore_load: route as if every adapter were resident and load on a miss (the
    # benchmark's ablation, bench/adapters.py)
    choice: Literal["predicted", "ignore_load"] = "predicted"


class BackendConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    url: str
    # one of the dialect registry's kinds (gateway/proxy/dialects KINDS), checked by parse_config
    kind: str = "openai"
    models: list[str] = msgspec.field(default_factory=list)
    model_map: dict[str, str] = msgspec.field(default_factory=dict)  # our model name -> upstream's name
    location: Location | None = None
    retention: str = "none"  # "zero" | "none" (unknown/unbounded) | "<N>d" days
    operator: Literal["self", "partner"] = "self"
    api_key_env: str | None = None
    api_key_file: str | None = None
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    limits: PoolLimits = msgspec.field(default_factory=PoolLimits)
    health: HealthCheck = msgspec.field(default_factory=HealthCheck)
    # engine telemetry (the kinds that publish KV events and metrics: vllm, sim, sglang)
    kv_events: str | None = None
    replay: str | None = None
    kv_topic: str | None = None  # this engine's KV-event topic; null: telemetry.kv_topic ("" = every topic)
    # "full": every request to this vLLM engine carries vllm_xargs {"kv_cache_report_mode": "full"}, so the engine
    # also announces the blocks it reuses (the KV index takes those as re-announcements, not new copies)
    kv_cache_report_mode: Literal["incremental", "full"] = "incremental"
    metrics: str | None = None
    priority_scheduling: bool = False
    # the order the engine runs `priority` values in; null: its kind's default (vllm/sim: lower first; sglang:
    # higher first, the gateway then negates the routing.priority_values it sends; true for an SGLang engine run
    # with --schedule-low-priority-values-first)
    priority_low_values_first: bool | None = None
    # an inference_gateway upstream's endpoint picker then queues by the same flows (gateway/routing/flowkey.py)
    # and priorities as the gateway's own fair queue (docs/routing.md, "Inference gateway upstreams")
    inference_gateway: bool = False  # the upstream is itself a Gateway API Inference Extension / llm-d gateway: it is sent the flow (x-llm-d-inference-fairness-id / x-gateway-inference-fairness-id), the policy priority (x-llm-d-inference-objective / x-gateway-inference-objective) and the policy TTFT target (x-llm-d-slo-ttft-ms / x-slo-ttft-ms)
    inference_gateway_headers: Literal["both", "llm-d", "gie"] = "both"  # which spelling of those headers an inference_gateway upstream is sent: both, llm-d (x-llm-d-*) or gie (x-gateway-inference-*, x-slo-*); docs/routing.md
    # upstream model names that are LoRA adapters (vLLM --lora-modules NAME=PATH; SGLang `<base>:<adapter>`, with
    # model_map sending the client's name as that): their KV blocks are keyed by the adapter name, so the KV-index
    # lookup for a request to one uses that name (else it would match base blocks the adapter cannot reuse)
    lora_adapters: list[str] = msgspec.field(default_factory=list)
    lora: LoraPlacement | None = None  # runtime adapter loading (docs/adapters.md, "Placement")
    context_window: int | None = None
    capabilities: list[str] = msgspec.field(default_factory=lambda: ["chat", "completions"])
    weight: float = 1.0
    # requests this gateway process may have in flight to this upstream at once (null: no limit); past it a request
    # waits in the gateway (one with a TTFT target is refused: 429 backend_inflight_limit). The one way to queue
    # for an upstream the gateway has no model of (gateway/routing/limits.py)
    max_inflight: int | None = None
    # Partner routes behind an egress proxy (opt-in per backend; such a backend uses the httpx client):
    # trust_env reads HTTPS_PROXY/HTTP_PROXY/ALL_PROXY/NO_PROXY (and SSL_CERT_FILE) from the environment
    trust_env: bool = False  # honour HTTPS_PROXY / HTTP_PROXY / NO_PROXY for this backend
    proxy: str | None = None  # an explicit http(s):// proxy URL for this backend (the environment is not read)
    discovery: DnsDiscovery | None = None  # expand into one backend `<name>-<a-b-c-d>` per resolved address (url, kv_events, replay, metrics pointed at it)

    @property
    def retention_days(self) -> int | None:
        """0 for zero retention, N for "<N>d", None for unknown/unbounded."""
        if self.retention == "zero":
            return 0
        m = re.fullmatch(r"(\d+)d", self.retention)
        return int(m.group(1)) if m else None

    @property
    def server_root(self) -> str:
        """The URL without a trailing /v1, where vLLM serves /health, /metrics, /tokenize."""
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u

    def upstream_model(self, model: str) -> str:
        return self.model_map.get(model, model)


class StaticKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenant: str
    key_env: str | None = None
    key: str | None = None  # literal value; allowed for tests and demos, prefer key_env
    team: str | None = None
    project: str | None = None
    partner: str | None = None
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    models: list[str] = msgspec.field(default_factory=list)
    scopes: list[str] = msgspec.field(default_factory=list)
    name: str | None = None


class AdminConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key_env: str | None = None
    key: str | None = None


class AliasConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model alias: a name clients use, resolved to a chain of models tried in order (fallbacks). A target may
    carry a weight (a weighted canary rollout: docs/rollouts.md); plain strings are the ordered chain."""

    name: str
    targets: list[str | AliasTarget]
    sticky: StickyConfig = msgspec.field(default_factory=StickyConfig)  # what keeps one user on one arm
    rollback: RollbackConfig = msgspec.field(default_factory=RollbackConfig)  # automatic rollback thresholds

    @property
    def models(self) -> list[str]:
        """The target models in config order (the fallback chain); shadow targets are not in it."""
        return [t if isinstance(t, str) else t.model for t in self.targets
                if isinstance(t, str) or t.shadow is None]

    @property
    def all_models(self) -> list[str]:
        """Every target's model, shadows included, in config order."""
        return [t if isinstance(t, str) else t.model for t in self.targets]


class ObservabilityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    otlp_endpoint: str | None = None  # off by default
    service_name: str = "policy-gateway"
    capture_content: bool = False
    log_level: str = "info"
    json_logs: bool = True


class GatewayConfigRaw(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    backends: list[BackendConfig] = msgspec.field(default_factory=list)
    aliases: list[AliasConfig] = msgspec.field(default_factory=list)
    keys: list[StaticKey] = msgspec.field(default_factory=list)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    identity: IdentityConfig = msgspec.field(default_factory=IdentityConfig)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    budgets: BudgetsConfig = msgspec.field(default_factory=BudgetsConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    observability: ObservabilityConfig = msgspec.field(default_factory=ObservabilityConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    cost: CostConfig = msgspec.field(default_factory=CostConfig)  # what each backend costs (docs/cost.md)
    data_dir: str = "var"


@dataclass(frozen=True)
class Config:
    """An immutable, validated snapshot plus where it came from. Hot reload swaps the whole object."""

    raw: GatewayConfigRaw
    path: Path | None
    base_dir: Path
    models: dict[str, tuple[str, ...]] = field(default_factory=dict)  # model -> backend names serving it
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    generation: int = 0
    # name -> backend (the first of a name, as the list scan did): `backend` is looked up several times per request
    _by_name: dict[str, BackendConfig] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for b in self.raw.backends:
            self._by_name.setdefault(b.name, b)

    @property
    def server(self) -> ServerConfig:
        return self.raw.server

    @property
    def backends(self) -> list[BackendConfig]:
        return self.raw.backends

    def backend(self, name: str) -> BackendConfig:
        b = self._by_name.get(name)
        if b is None:
            raise KeyError(name)
        return b

    def resolve_path(self, p: str) -> Path:
        path = Path(os.path.expandvars(p))
        return path if path.is_absolute() else self.base_dir / path

    def resolve_model(self, model: str) -> tuple[str, ...]:
        """The chain of concrete model names to try for a requested name (an alias or a model)."""
        if model in self.aliases:
            return self.aliases[model]
        if model in self.models:
            return (model,)
        return ()


# ----------------------------------------------------------------------------------------------- loading


MAX_YAML_NODES = 200_000
"""Most YAML nodes one document may expand to (aliases count each time they are used): bounds the
"billion laughs" alias bomb, which would otherwise expand exponentially in time and memory."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of a YAML document (deeper documents would exhaust the parser's recursion)."""


def _node_to_py(node: yaml.Node, marks: dict[str, int], path: str, budget: list[int] | None = None,
                depth: int = 0) -> Any:
    budget = budget if budget is not None else [MAX_YAML_NODES]
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"line {node.start_mark.line + 1}: {path or '(top level)'}: document expands to more "
                          f"than {MAX_YAML_NODES} nodes (alias bomb?)")
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"line {node.start_mark.line + 1}: {path or '(top level)'}: nested deeper than "
                          f"{MAX_YAML_DEPTH} levels")
    marks[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise ConfigError(f"line {k.start_mark.line + 1}: {path or '(top level)'}: keys must be scalars")
            key = yaml.constructor.SafeConstructor().construct_object(k)  # scalars only
            sub = f"{path}.{key}" if path else str(key)
            marks[sub] = k.start_mark.line + 1
            if key in out:
                raise ConfigError(f"line {k.start_mark.line + 1}: {sub}: duplicate key")
            out[key] = _node_to_py(v, marks, sub, budget, depth + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_node_to_py(v, marks, f"{path}[{i}]", budget, depth + 1) for i, v in enumerate(node.value)]
    return yaml.constructor.SafeConstructor().construct_object(node)


def load_yaml_with_lines(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """Parse YAML safely, returning the data and a map from key path ("a.b[0].c") to line number."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:  # a scanner, parser or composer error: where and what
        line = f":{e.problem_mark.line + 1}" if e.problem_mark else ""
        raise ConfigError(f"{source}{line}: invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    marks: dict[str, int] = {}
    if node is None:
        return {}, marks
    try:
        return _node_to_py(node, marks, ""), marks
    except ConfigError as e:
        raise ConfigError(f"{source}:{str(e).removeprefix('line ')}") from None
    except (yaml.YAMLError, TypeError, ValueError, OverflowError) as e:  # unhashable keys, bad tags, ...
        raise ConfigError(f"{source}: invalid YAML: {e}") from None


def _msgspec_path(msg: str) -> str:
    """msgspec says `... - at `$.backends[0].url``; return `backends[0].url`."""
    m = re.search(r"at `\$\.?(.*?)`", msg)
    return m.group(1) if m else ""


def _line_for(path: str, marks: dict[str, int]) -> int | None:
    while path:
        if path in marks:
            return marks[path]
        shorter = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", path)
        if shorter == path:  # a key the pattern cannot strip (ends in "." or "[", ...): cut at the last separator
            cut = max(path.rfind("."), path.rfind("["))
            shorter = path[:cut] if cut > 0 else ""
        path = shorter
    return marks.get("")


def _fail(source: str, marks: dict[str, int], key: str, problem: str) -> ConfigError:
    line = _line_for(key, marks)
    where = f"{source}:{line}" if line else source
    return ConfigError(f"{where}: {key or '(top level)'}: {problem}")


_COUNTRY = re.compile(r"[A-Z]{2}")


def _expand_discovered(raw: GatewayConfigRaw, models: dict[str, list[str]], source: str,
                       path: Path | None) -> tuple[GatewayConfigRaw, dict[str, list[str]]]:
    """Discovery templates become one backend per address resolved so far (gateway/discovery.py); a model
    served only by a group with no address yet stays known, with no backend."""
    backends = discovery.expand(list(raw.backends), str(path) if path is not None else None)
    if backends is raw.backends or all(b.discovery is None for b in raw.backends):
        return raw, models
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"{source}: backends: discovered backend names collide with configured ones: {dup}")
    served: dict[str, list[str]] = {m: [] for m in models}
    for b in backends:
        for m in b.models:
            served.setdefault(m, []).append(b.name)
    return msgspec.structs.replace(raw, backends=backends), served


_Problem = tuple[str, str]  # (key, what is wrong with it), for _fail


def _validation_problem(msg: str) -> _Problem:
    """msgspec's ValidationError text as (key, problem); an unknown field is named in the key."""
    key = _msgspec_path(msg)
    problem = re.sub(r"\s*-\s*at `.*?`$", "", msg)
    if problem.startswith("Object contains unknown field"):
        fld = re.search(r"`(.*?)`", problem)
        if fld:
            key = f"{key}.{fld.group(1)}" if key else fld.group(1)
        problem = "unknown key"
    return key, problem


def _backend_kind_problem(k: str, b: BackendConfig) -> _Problem | None:
    from gateway.proxy.dialects import DIALECTS, KINDS

    if b.kind not in DIALECTS:
        return f"{k}.kind", f"must be one of {', '.join(KINDS)}, got {b.kind!r}"
    if b.kv_cache_report_mode == "full" and not DIALECTS[b.kind].kv_report_full:
        return f"{k}.kv_cache_report_mode", (f"'full' is vLLM's (kinds "
                                             f"{', '.join(k2 for k2 in KINDS if DIALECTS[k2].kv_report_full)}), "
                                             f"not kind {b.kind}'s")
    return None


def _location_problem(k: str, location: Location | None) -> _Problem | None:
    if location is not None:
        for attr, v in (("country", location.country), ("storage_country", location.storage_country)):
            if v is not None and not _COUNTRY.fullmatch(v):
                return f"{k}.location.{attr}", f"must be an ISO 3166 alpha-2 code like DE, got {v!r}"
            why = country_error(v) if v is not None else None
            if why is not None:
                return f"{k}.location.{attr}", why
    return None


def _backend_fields_problem(k: str, b: BackendConfig) -> _Problem | None:
    """url, models, lora, location and retention of one backend."""
    if not re.match(r"^https?://[^/\s]+", b.url):
        return f"{k}.url", f"must be an http(s) URL, got {b.url!r}"
    if not b.models:
        return f"{k}.models", "a backend must serve at least one model"
    if b.lora is not None and b.lora.max_loras is not None and not 1 <= b.lora.max_loras <= 1024:
        return f"{k}.lora.max_loras", f"must be between 1 and 1024, got {b.lora.max_loras}"
    if b.lora is not None and not b.lora.refresh_s > 0:
        return f"{k}.lora.refresh_s", "must be > 0 (seconds)"
    bad_location = _location_problem(k, b.location)
    if bad_location is not None:
        return bad_location
    if b.retention != "zero" and b.retention != "none" and not re.fullmatch(r"\d+d", b.retention):
        return f"{k}.retention", f"must be 'zero', 'none' or '<N>d', got {b.retention!r}"
    return None


def _backend_secret_problem(k: str, b: BackendConfig, environ: Mapping[str, str],
                            base_dir: Path | None) -> _Problem | None:
    if b.api_key_env and b.api_key_env not in environ:
        return f"{k}.api_key_env", f"environment variable {b.api_key_env} is not set"
    if b.api_key_file and not (base_dir or Path.cwd()).joinpath(b.api_key_file).exists():
        return f"{k}.api_key_file", f"file {b.api_key_file} does not exist"
    return None


def _backend_transport_problem(k: str, b: BackendConfig) -> _Problem | None:
    """timeouts, proxy and discovery of one backend."""
    t = b.timeouts
    for tname, v in (("connect_s", t.connect_s), ("first_token_s", t.first_token_s), ("idle_s", t.idle_s),
                     ("total_s", t.total_s)):
        if v <= 0:
            return f"{k}.timeouts.{tname}", "must be > 0"
    if b.proxy is not None:
        if not re.match(r"^https?://[^/\s]+", b.proxy):
            return f"{k}.proxy", f"must be an http:// or https:// URL, got {b.proxy!r}"
        if b.trust_env:
            return f"{k}.proxy", ("set either proxy or trust_env, not both (an "
                                  "explicit proxy ignores HTTPS_PROXY/NO_PROXY)")
    if b.discovery is not None:
        if not b.discovery.dns.strip():
            return f"{k}.discovery.dns", "must be a DNS name"
        if b.discovery.refresh_s <= 0:
            return f"{k}.discovery.refresh_s", "must be > 0 (seconds)"
        if b.discovery.port is not None and not 0 < b.discovery.port < 65536:
            return f"{k}.discovery.port", "must be between 1 and 65535"
    return None


def _backends_problem(backends: list[BackendConfig], environ: Mapping[str, str],
                      base_dir: Path | None) -> _Problem | None:
    """The first problem of the first bad backend, checked in file order."""
    names: set[str] = set()
    for i, b in enumerate(backends):
        k = f"backends[{i}]"
        bad = _backend_kind_problem(k, b)
        if bad is None and b.name in names:
            bad = f"{k}.name", f"duplicate backend name {b.name!r}"
        bad = (bad or _backend_fields_problem(k, b) or _backend_secret_problem(k, b, environ, base_dir)
               or _backend_transport_problem(k, b))
        if bad is not None:
            return bad
        names.add(b.name)
    return None


def _served_models(backends: list[BackendConfig]) -> dict[str, list[str]]:
    """model -> names of the backends serving it, in file order."""
    models: dict[str, list[str]] = {}
    for b in backends:
        for m in b.models:
            models.setdefault(m, []).append(b.name)
    return models


def _aliases_problem(aliases: list[AliasConfig], models: dict[str, list[str]]) -> _Problem | None:
    for i, a in enumerate(aliases):
        if a.name in models:
            return f"aliases[{i}].name", f"alias {a.name!r} shadows a served model"
        for j, t in enumerate(a.all_models):
            if t not in models:
                return f"aliases[{i}].targets[{j}]", f"no backend serves model {t!r}"
        if not a.targets:
            return f"aliases[{i}].targets", "an alias needs at least one target"
        bad_alias = alias_error(a)
        if bad_alias is not None:
            return f"aliases[{i}].{bad_alias[0]}", bad_alias[1]
    return None


def _keys_problem(raw: GatewayConfigRaw, environ: Mapping[str, str]) -> _Problem | None:
    """Static keys and the admin key: their environment variables must be set."""
    for i, sk in enumerate(raw.keys):
        if not sk.key_env and not sk.key:
            return f"keys[{i}]", "a static key needs key_env or key"
        if sk.key_env and not environ.get(sk.key_env):
            return f"keys[{i}].key_env", f"environment variable {sk.key_env} is not set"
    if raw.admin.key_env and not environ.get(raw.admin.key_env):
        return "admin.key_env", f"environment variable {raw.admin.key_env} is not set"
    return None


def _limits_problem(raw: GatewayConfigRaw) -> _Problem | None:
    """telemetry, server, policy audit and batch limits."""
    if raw.telemetry.kv_silence_grace_s <= 0:
        return "telemetry.kv_silence_grace_s", "must be > 0 (seconds)"
    if raw.server.port < 0 or raw.server.port > 65535:
        return "server.port", "must be between 0 and 65535"
    if raw.server.max_body_bytes <= 0:
        return "server.max_body_bytes", "must be > 0"
    if raw.policy.audit_max_bytes < 0:
        return "policy.audit_max_bytes", "must be >= 0 (0: never rotate)"
    if raw.policy.audit_max_bytes and raw.policy.audit_backups < 1:
        return "policy.audit_backups", ("must be >= 1 when policy.audit_max_bytes is set "
                                        "(rotating into no backup would delete records)")
    bad_batch = batch_error(raw.batch)
    if bad_batch is not None:
        return f"batch.{bad_batch[0]}", bad_batch[1]
    return None


def _stores_problem(raw: GatewayConfigRaw) -> _Problem | None:
    """trusted proxies, the budget and identity stores, and the routing strategy."""
    for i, tp in enumerate(raw.server.trusted_proxies):
        try:
            ipaddress.ip_network(tp, strict=False)
        except ValueError:
            return f"server.trusted_proxies[{i}]", f"{tp!r} is not an IP address or CIDR"
    if raw.budgets.store not in ("auto", "memory", "sqlite", "redis"):
        return "budgets.store", "must be 'auto', 'memory', 'sqlite' or 'redis'"
    if raw.budgets.on_store_error not in ("closed", "open"):
        return "budgets.on_store_error", "must be 'closed' or 'open'"
    if raw.budgets.reservation_ttl_s <= 0:
        return "budgets.reservation_ttl_s", "must be > 0"
    if raw.budgets.reserve_gpu_seconds is not None and raw.budgets.reserve_gpu_seconds < 0:
        return "budgets.reserve_gpu_seconds", ("must be >= 0 (omit it to reserve the longest "
                                               "request the backends allow)")
    if raw.identity.store not in ("sqlite", "postgres"):
        return "identity.store", "must be 'sqlite' or 'postgres'"
    bad_routing = raw.routing.strategy_error()  # gateway/routing/registry.py: presets and plugin lists
    if bad_routing is not None:
        return f"routing.{bad_routing[0]}", bad_routing[1]
    return None


def parse_config(text: str, source: str = "<config>", base_dir: Path | None = None, path: Path | None = None,
                 env: Mapping[str, str] | None = None) -> Config:
    """Validate config text into a snapshot, or raise ConfigError naming file:line: key."""
    environ: Mapping[str, str] = os.environ if env is None else env
    data, marks = load_yaml_with_lines(text, source)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: (top level): must be a mapping of sections, got {type(data).__name__}")
    try:
        raw = msgspec.convert(data, GatewayConfigRaw, strict=False)
    except msgspec.ValidationError as e:
        raise _fail(source, marks, *_validation_problem(str(e))) from None

    # ---- semantic checks, in file order; the first problem found is the one reported
    if raw.server.gc_threshold is not None and any(t < 1 for t in raw.server.gc_threshold):
        raise _fail(source, marks, "server.gc_threshold", "thresholds must be positive integers")
    bad = _backends_problem(raw.backends, environ, base_dir)
    if bad is not None:
        raise _fail(source, marks, *bad)
    raw, models = _expand_discovered(raw, _served_models(raw.backends), source, path)
    bad = _aliases_problem(raw.aliases, models) or _keys_problem(raw, environ) or _limits_problem(raw) \
        or _stores_problem(raw)
    if bad is not None:
        raise _fail(source, marks, *bad)
    aliases = {a.name: tuple(a.models) for a in raw.aliases}
    bd = base_dir or Path.cwd()
    return Config(raw=raw, path=path, base_dir=bd, models={m: tuple(v) for m, v in models.items()}, aliases=aliases)


def load_config(path: str | Path, env: dict[str, str] | None = None) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    return parse_config(text, source=str(p), base_dir=p.resolve().parent, path=p.resolve(), env=env)


def read_secret(env_name: str | None, file: str | None, base_dir: Path) -> str | None:
    """A credential from an env var or a file (stripped); never logged (registered for log redaction)."""
    from gateway.observability.logs import register_secret

    value = None
    if env_name:
        value = os.environ.get(env_name)
    elif file:
        value = (base_dir / file).read_text(encoding="utf-8").strip()
    register_secret(value)
    return value
