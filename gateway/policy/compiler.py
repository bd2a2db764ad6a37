"""Compile YAML policy files into a `CompiledPolicy`: schema check, semantic checks, precompiled predicates.

Every error names file:line and the key (`policies/tenants.yaml:14: rules[2].require.jurisdiction: ...`).
The compiler rejects contradictions it can see statically (see docs/policy.md, "Contradictions").
"""
from __future__ import annotations

import fnmatch
import json
import re
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Pattern
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import jsonschema

from gateway.config import ConfigError, load_yaml_with_lines
from gateway.policy.eea import JURISDICTIONS, country_error
from gateway.policy.engine import CompiledPolicy
from gateway.policy.model import Condition, Predicate, RequestAttrs, Rule
from gateway.budget.dimensions import DIMENSIONS
from gateway.budget.windows import WINDOWS
from gateway.types import BudgetSpec, Principal

# package data (importlib.resources), so an installed wheel validates policies too; policies/schema.json is a
# link to it for editors (tests/packaging/test_package_data.py)
SCHEMA_RESOURCE = resources.files("gateway.policy") / "schema.json"

_GLOB_CHARS = re.compile(r"[*?\[]")
_COUNTRY = re.compile(r"^[A-Z]{2}$")
_Doc = dict[str, Any]  # a YAML mapping of a policy document
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
# principal attribute -> (Principal field, specificity level, index priority)
_PRINCIPAL_ATTRS = {
    "key": ("key_id", 5),
    "project": ("project", 4),
    "team": ("team", 3),
    "tenant": ("tenant", 2),
    "partner": ("partner", 2),
    "kind": ("kind", 1),
}
_ALIASES = {
    "key_id": "key", "key.id": "key", "principal.key": "key", "principal.key_id": "key",
    "principal.tenant": "tenant", "principal.team": "team", "principal.project": "project",
    "principal.partner": "partner", "principal.kind": "kind",
    "key.scopes": "scopes", "principal.scopes": "scopes",
    "request.model": "model", "models": "model",
    "request.max_tokens": "max_tokens", "request.stream": "stream", "request.time": "time",
}


class PolicyError(Exception):
    """Policies that cannot be used. `errors` lists every problem as "file:line: key: message"."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The policy schema policies are validated with: schema.json, its `budget` object built from the budget
    dimensions' table (the file's copy, for editors, is checked against it by tests/policy/test_schema.py)."""
    schema = json.loads(SCHEMA_RESOURCE.read_text(encoding="utf-8"))
    schema["$defs"]["budget"] = budget_schema()
    return schema


def budget_schema() -> dict[str, object]:
    """The JSON Schema of one `budgets:` entry: window, scope, a limit per budget dimension (its keys), currency."""
    props: dict[str, object] = {
        "window": {"enum": list(WINDOWS)},
        "scope": {"enum": list(_SCOPE_LEVELS),
                  "description": "Default: the most specific principal attribute in match, else tenant."}}
    for d in DIMENSIONS:
        props.update({k: {**v, "description": v.get("description", d.description)} for k, v in d.schema.items()})
    if any(d.currency for d in DIMENSIONS):
        props["currency"] = {"type": "string", "pattern": "^[A-Z]{3}$"}
    return {"type": "object", "additionalProperties": False, "properties": props, "required": ["window"],
            "anyOf": [{"required": [k]} for d in DIMENSIONS for k in d.schema]}


def write_schema(path: Path | None = None) -> bool:
    """Rewrite the `budget` object of the policy schema file (default: the packaged schema.json) from the table,
    leaving the rest of the file as written. True when the file changed."""
    target = path or Path(str(SCHEMA_RESOURCE))
    text = target.read_text(encoding="utf-8")
    key = '\n    "budget": '
    start = text.index(key) + len(key)
    _, end = json.JSONDecoder().raw_decode(text, start)
    new = text[:start] + _render(budget_schema(), 4) + text[end:]
    if new == text:
        return False
    target.write_text(new, encoding="utf-8")
    return True


def _render(v: object, indent: int) -> str:
    """schema.json's layout: an object's members one per line, anything short enough on one line."""
    flat = json.dumps(v, ensure_ascii=False)
    if not isinstance(v, dict) or len(flat) + indent <= 100:
        return flat
    pad = " " * (indent + 2)
    body = ",\n".join(f"{pad}{json.dumps(k)}: {_render(x, indent + 2)}" for k, x in v.items())
    return "{\n" + body + "\n" + " " * indent + "}"


class _Src:
    """Where a policy document came from, to turn a key path into file:line."""

    def __init__(self, source: str, marks: dict[str, int]) -> None:
        self.source, self.marks = source, marks

    def line(self, path: str) -> int | None:
        while path:
            if path in self.marks:
                return self.marks[path]
            path = re.sub(r"(\.[^.\[]+|\[\d+\])$", "", path)
        return self.marks.get("")

    def err(self, path: str, msg: str) -> str:
        ln = self.line(path)
        return f"{self.source}:{ln}: {path or '(top level)'}: {msg}" if ln else f"{self.source}: {path}: {msg}"


def _json_path(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# ----------------------------------------------------------------------------------------------- predicates


def glob_regex(patterns: Iterable[str]) -> Pattern[str]:
    """One compiled regex matching any of the globs (fnmatch syntax, case-sensitive)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


class _StrMatch:
    """A value test: exact set membership for plain strings, one regex for globs."""

    __slots__ = ("exact", "regex", "values")

    def __init__(self, spec: Any) -> None:
        self.values = [str(v) for v in _as_list(spec)]
        self.exact = frozenset(v for v in self.values if not _GLOB_CHARS.search(v))
        globs = [v for v in self.values if _GLOB_CHARS.search(v)]
        self.regex = glob_regex(globs) if globs else None

    @property
    def exact_only(self) -> bool:
        return self.regex is None

    def __call__(self, value: str | None) -> bool:
        if value is None:
            return False
        if value in self.exact:
            return True
        return self.regex is not None and self.regex.match(value) is not None

    def __str__(self) -> str:
        return self.values[0] if len(self.values) == 1 else f"any of {self.values}"


def _principal_cond(name: str, attr: str, m: _StrMatch) -> Condition:
    if m.exact_only:
        ex = m.exact

        def test(p: Principal, r: RequestAttrs) -> bool:
            return getattr(p, attr) in ex

        return Condition(name, f"{name} is {m}", test, dim=name, exact=ex)

    def gtest(p: Principal, r: RequestAttrs) -> bool:
        return m(getattr(p, attr))

    return Condition(name, f"{name} is {m}", gtest)


def _label_cond(key: str, m: _StrMatch) -> Condition:
    if m.exact_only:
        ex = m.exact
        return Condition(f"labels.{key}", f"principal label {key} is {m}", lambda p, r: p.labels.get(key) in ex,
                         dim=f"label:{key}", exact=ex)
    return Condition(f"labels.{key}", f"principal label {key} is {m}", lambda p, r: m(p.labels.get(key)))


def _scopes_cond(m: _StrMatch) -> Condition:
    def test(p: Principal, r: RequestAttrs) -> bool:
        for s in p.scopes:
            if m(s):
                return True
        return False

    return Condition("scopes", f"key scopes include {m}", test)


def _model_cond(m: _StrMatch) -> Condition:
    if m.exact_only:
        ex = m.exact
        return Condition("model", f"model is {m}", lambda p, r: r.model in ex, dim="model", exact=ex)
    return Condition("model", f"model is {m}", lambda p, r: m(r.model))


def _header_cond(name: str, spec: Any) -> Condition:
    if spec is True or spec == "*":
        return Condition(f"headers.{name}", f"header {name} is present", lambda p, r: name in r.headers)
    if spec is False or spec is None:
        return Condition(f"headers.{name}", f"header {name} is absent", lambda p, r: name not in r.headers)
    m = _StrMatch(spec)
    if m.exact_only:
        ex = m.exact
        return Condition(f"headers.{name}", f"header {name} is {m}", lambda p, r: r.headers.get(name) in ex)
    return Condition(f"headers.{name}", f"header {name} is {m}", lambda p, r: m(r.headers.get(name)))


def _range_test(spec: Any) -> tuple[Any, str, tuple[float, float, bool, bool]]:
    """max_tokens: int (equality) or {gt,gte,lt,lte}. A request without max_tokens never matches a range
    (cap it with `set: {max_tokens: N}` instead)."""
    if isinstance(spec, int):
        spec = {"gte": spec, "lte": spec}
    lo, hi = float("-inf"), float("inf")
    lo_incl = hi_incl = True
    if "gt" in spec:
        lo, lo_incl = spec["gt"], False
    if "gte" in spec:
        lo, lo_incl = spec["gte"], True
    if "lt" in spec:
        hi, hi_incl = spec["lt"], False
    if "lte" in spec:
        hi, hi_incl = spec["lte"], True

    def test(p: Principal, r: RequestAttrs) -> bool:
        v = r.max_tokens
        if v is None:
            return False
        if v < lo or (v == lo and not lo_incl):
            return False
        if v > hi or (v == hi and not hi_incl):
            return False
        return True

    desc = " and ".join(f"{k} {v}" for k, v in spec.items())
    return test, f"max_tokens {desc} (absent never matches)", (lo, hi, lo_incl, hi_incl)


def _stream_test(want: bool) -> Predicate:
    return lambda p, r: r.stream is want


def _time_cond(spec: dict[str, Any]) -> Condition:
    tz = ZoneInfo(spec.get("tz", "UTC"))
    days = frozenset(_DAYS.index(d) for d in spec.get("days", _DAYS))
    hours = spec.get("hours")
    window: tuple[int, int] | None = None  # (from, to) in minutes of the day; None: any time of day
    if hours:
        a, b = hours.split("-")
        window = (int(a[:2]) * 60 + int(a[3:5]), int(b[:2]) * 60 + int(b[3:5]))

    def test(p: Principal, r: RequestAttrs) -> bool:
        t = datetime.fromtimestamp(r.now, tz)
        if t.weekday() not in days:
            return False
        if window is None:
            return True
        lo_min, hi_min = window
        m = t.hour * 60 + t.minute
        return lo_min <= m < hi_min if lo_min <= hi_min else (m >= lo_min or m < hi_min)

    return Condition("time", f"time within {spec}", test)


# ----------------------------------------------------------------------------------------------- compile


def _normalize_match(match: dict[str, Any]) -> dict[str, Any]:
    """Fold the dotted spellings (`principal.labels.x`, `header.x`, `key.scopes`) into one canonical dict."""
    out: dict[str, Any] = {}
    for k, v in match.items():
        k = _ALIASES.get(k, k)
        for prefix, group in (("principal.labels.", "labels"), ("labels.", "labels"),
                              ("header.", "headers"), ("headers.", "headers"), ("request.headers.", "headers")):
            if k.startswith(prefix):
                out.setdefault(group, {})[k[len(prefix):].lower() if group == "headers" else k[len(prefix):]] = v
                break
        else:
            if k in ("labels", "headers") and isinstance(v, dict):
                d = out.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk.lower() if k == "headers" else kk] = vv
            else:
                out[k] = v
    return out


_SCOPE_LEVELS = ("key", "project", "team", "tenant", "partner")


def _rule_scope(match: dict[str, Any]) -> str:
    """The principal level a rule is about: the most specific of key > project > team > tenant > partner it matches
    on, else tenant. Budgets without `scope` are charged there and `share` weighs that level's flow."""
    for s in _SCOPE_LEVELS:
        if s in match:
            return s
    return "tenant"


def _principal_conditions(match: _Doc) -> tuple[list[Condition], int]:
    """Conditions on who is asking (key .. kind, labels, scopes) and the specificity level they give the rule."""
    conds: list[Condition] = []
    level = 0
    for name, (attr, lvl) in _PRINCIPAL_ATTRS.items():
        if name in match:
            conds.append(_principal_cond(name, attr, _StrMatch(match[name])))
            level = max(level, lvl)
    for k, v in (match.get("labels") or {}).items():
        conds.append(_label_cond(k, _StrMatch(v)))
        level = max(level, 1)
    if "scopes" in match:
        conds.append(_scopes_cond(_StrMatch(match["scopes"])))
        level = max(level, 1)
    return conds, level


def _request_conditions(match: _Doc, path: str, src: _Src, errors: list[str]) -> list[Condition] | None:
    """Conditions on the request (model, headers, max_tokens, stream, time); None: an unknown time zone."""
    conds: list[Condition] = []
    if "model" in match:
        conds.append(_model_cond(_StrMatch(match["model"])))
    for k, v in (match.get("headers") or {}).items():
        conds.append(_header_cond(k, v))
    if "max_tokens" in match:
        test, desc, (lo, hi, li, hi_i) = _range_test(match["max_tokens"])
        if lo > hi or (lo == hi and not (li and hi_i)):
            errors.append(src.err(f"{path}.match.max_tokens", "range is empty: this rule can never match"))
        conds.append(Condition("max_tokens", desc, test))
    if "stream" in match:
        want = bool(match["stream"])
        conds.append(Condition("stream", f"stream is {want}", _stream_test(want)))
    if "time" in match:
        t = match["time"]
        if "tz" in t:
            try:
                ZoneInfo(t["tz"])
            except (ZoneInfoNotFoundError, ValueError):
                errors.append(src.err(f"{path}.match.time.tz", f"unknown time zone {t['tz']!r}"))
                return None
        conds.append(_time_cond(t))
    return conds


def _match_conditions(match: _Doc, path: str, src: _Src, errors: list[str]) -> tuple[list[Condition], int] | None:
    """All the conditions of `match` and the rule's specificity level; None (errors appended) when unusable."""
    try:
        conds, level = _principal_conditions(match)
        request_conds = _request_conditions(match, path, src, errors)
    except re.error as e:
        errors.append(src.err(f"{path}.match", f"bad pattern: {e}"))
        return None
    if request_conds is None:
        return None
    return conds + request_conds, level


def _jurisdiction(spec: object, path: str, src: _Src, errors: list[str]) -> tuple[frozenset[str], str]:
    """`require.jurisdiction` -> (allowed country codes, the label naming them); bad entries go to `errors`."""
    codes: set[str] = set()
    labels: list[str] = []
    for item in _as_list(spec):
        item = str(item).upper()
        if item in JURISDICTIONS:
            codes |= JURISDICTIONS[item]
            labels.append(item)
        elif item == "EL":  # the EU's abbreviation for Greece
            codes.add("GR")
            labels.append("GR")
        elif _COUNTRY.match(item) and country_error(item) is None:
            codes.add(item)
            labels.append(item)
        elif _COUNTRY.match(item):
            errors.append(src.err(f"{path}.require.jurisdiction", str(country_error(item))))
        else:
            errors.append(src.err(f"{path}.require.jurisdiction",
                                  f"{item!r} is neither a jurisdiction ({', '.join(JURISDICTIONS)}) "
                                  "nor an ISO 3166 alpha-2 country code"))
    return frozenset(codes), ",".join(labels)


# `set:` keys copied into Rule.sets: (spelling in the file, key in sets)
_SET_KEYS = (("priority", "priority"), ("ttft_slo_ms", "ttft_slo_ms"), ("ttft_target_ms", "ttft_slo_ms"),
             ("long_ttft_slo_ms", "long_ttft_slo_ms"), ("long_ttft_target_ms", "long_ttft_slo_ms"),
             ("max_tokens", "max_tokens_cap"), ("max_context", "max_context"),
             ("spill_to_partner", "spill_to_partner"))


def _allowed_models(sets_raw: _Doc) -> tuple[str, ...]:
    """`set.models` and `set.allowed_models` together (popped from `sets_raw`)."""
    allowed_models = tuple(str(m) for m in _as_list(sets_raw.pop("models", []) or []))
    if "allowed_models" in sets_raw:
        allowed_models += tuple(str(m) for m in _as_list(sets_raw.pop("allowed_models")))
    return allowed_models


def _rule_sets(sets_raw: _Doc, rule_scope: str, path: str, src: _Src, errors: list[str]) -> _Doc:
    """The rest of `set:` (after _allowed_models and cache_isolation) as Rule.sets."""
    sets: _Doc = {}
    for k, dk in _SET_KEYS:
        if k in sets_raw:
            v = sets_raw[k]
            if k == "priority" and v == "sheddable":
                v = "batch"
            sets[dk] = float(v) if dk == "long_ttft_slo_ms" else v
    if "share" in sets_raw:  # the weight in the fair queue of the flow this rule's scope names (flowkey.flow_id)
        sets["share"] = float(sets_raw["share"])
        sets["share_scope"] = rule_scope  # set together, so the rule that wins `share` also names its flow
    if "cache" in sets_raw:  # the response cache of matching requests (gateway/cache, docs/cache.md)
        from gateway.cache.spec import compile_spec

        spec, why = compile_spec(sets_raw["cache"])
        if why is not None:
            errors.append(src.err(f"{path}.set.cache", why))
        else:
            sets["cache"] = spec
    return sets


def _deny(deny_raw: object) -> tuple[bool, tuple[str, ...]]:
    """`deny:` -> (deny everything, denied model globs)."""
    deny = deny_raw is True
    deny_models: tuple[str, ...] = ()
    if isinstance(deny_raw, dict):
        deny_models = tuple(str(m) for m in _as_list(deny_raw.get("models", [])))
        deny = deny or bool(deny_raw.get("all", False))
    return deny, deny_models


def _budgets(raw_budgets: list[_Doc], rid: str, default_scope: str, path: str, src: _Src,
             errors: list[str]) -> list[BudgetSpec]:
    """`budgets:` as BudgetSpecs charged at `default_scope` unless they name one: a limit per budget dimension
    (gateway/budget/dimensions.py) the entry names; a value that cannot be read (money) goes to `errors`."""
    budgets: list[BudgetSpec] = []
    for j, b in enumerate(raw_budgets):
        limits: list[tuple[str, float]] = []
        currency = b.get("currency")
        try:
            for d in DIMENSIONS:
                value, unit = d.policy_value(b)
                if value is not None:
                    limits.append((d.name, value))
                    currency = currency or unit
        except ValueError as e:
            errors.append(src.err(f"{path}.budgets[{j}]", str(e)))
            continue
        budgets.append(BudgetSpec(window=b["window"], scope=b.get("scope", default_scope), limits=limits,
                                  currency=currency or "EUR", rule_id=rid))
    return budgets


def _check_rule_models(match: _Doc, allowed_models: tuple[str, ...], deny_models: tuple[str, ...], path: str,
                       src: _Src, errors: list[str]) -> None:
    """Static contradictions inside one rule: a model match outside its own allow list, or deny == allow."""
    if allowed_models and "model" in match:
        mm = _StrMatch(match["model"])
        am = glob_regex(allowed_models)
        if mm.exact_only and not any(am.match(m) for m in mm.exact):
            errors.append(src.err(f"{path}.set.models", f"matches only model {mm} but allows only {list(allowed_models)}:"
                                  " every matching request would be denied; use deny instead"))
    if allowed_models and deny_models:
        dm = glob_regex(deny_models)
        if all(not _GLOB_CHARS.search(a) and dm.match(a) for a in allowed_models):
            errors.append(src.err(f"{path}.deny.models", "denies every model the same rule allows"))


def _compile_rule(raw: _Doc, order: int, path: str, src: _Src, errors: list[str]) -> Rule | None:
    rid = raw["id"]
    match = _normalize_match(raw.get("match") or {})
    compiled = _match_conditions(match, path, src, errors)
    if compiled is None:
        return None
    conds, level = compiled

    require = raw.get("require") or {}
    countries: frozenset[str] | None = None
    jurisdiction: str | None = None
    if "jurisdiction" in require:
        countries, jurisdiction = _jurisdiction(require["jurisdiction"], path, src, errors)
    retention_zero = require.get("retention") == "zero"

    sets_raw = dict(raw.get("set") or {})
    allowed_models = _allowed_models(sets_raw)
    cache_isolation = bool(sets_raw.pop("cache_isolation", False))
    rule_scope = _rule_scope(match)
    sets = _rule_sets(sets_raw, rule_scope, path, src, errors)

    deny, deny_models = _deny(raw.get("deny"))
    allow = raw.get("allow") is True
    if allow and (deny or deny_models):
        errors.append(src.err(f"{path}.allow", "a rule cannot both allow and deny"))

    budgets = _budgets(raw.get("budgets") or [], rid, rule_scope, path, src, errors)
    _check_rule_models(match, allowed_models, deny_models, path, src, errors)

    specificity = (level, len(conds))
    match_key = json.dumps(match, sort_keys=True, default=str)
    rm = glob_regex(deny_models) if deny_models else None
    return Rule(id=rid, order=order, source=f"{src.source}:{src.line(path) or '?'}", conditions=tuple(conds),
                specificity=specificity, allow=allow, deny=deny, deny_models=deny_models, deny_models_re=rm,
                allowed_models=allowed_models, allowed_models_re=glob_regex(allowed_models) if allowed_models else None,
                countries=countries, jurisdiction=jurisdiction, retention_zero=retention_zero, sets=sets,
                cache_isolation=cache_isolation, budgets=tuple(budgets), reason=raw.get("reason"),
                match_key=match_key)


def _check_pairs(rules: list[Rule], errors: list[str]) -> None:
    """Contradictions between rules with identical conditions: the author cannot have meant both."""
    by_key: dict[str, list[Rule]] = {}
    for r in rules:
        by_key.setdefault(r.match_key, []).append(r)
    for group in by_key.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                where = f"{b.source}: rules[{b.id}]"
                if a.countries is not None and b.countries is not None and not (a.countries & b.countries):
                    errors.append(f"{where}: requires jurisdiction {b.jurisdiction} but rule {a.id!r} ({a.source}) "
                                  f"with the same match requires {a.jurisdiction}: no backend can satisfy both")
                for k in set(a.sets) & set(b.sets):
                    if a.sets[k] != b.sets[k]:
                        errors.append(f"{where}: sets {k}={b.sets[k]!r} but rule {a.id!r} ({a.source}) with the same "
                                      f"match sets {k}={a.sets[k]!r}; merge them or make one more specific")
                if (a.allow and b.deny) or (a.deny and b.allow):
                    errors.append(f"{where}: allows and rule {a.id!r} ({a.source}) denies under the same match")


def parse_documents(docs: list[tuple[str, str]], default_allow: bool = True,
                    ) -> tuple[list[Rule], list[tuple[str, int, dict[str, Any]]], bool]:
    """Validate and compile policy texts [(source, text)]; returns (rules, tests, default_allow) or raises."""
    schema = load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors: list[str] = []
    rules: list[Rule] = []
    tests: list[tuple[str, int, dict[str, Any]]] = []
    ids: dict[str, str] = {}
    for source, text in docs:
        try:
            data, marks = load_yaml_with_lines(text, source)
        except ConfigError as e:
            errors.append(str(e))
            continue
        src = _Src(source, marks)
        if data in (None, {}):
            continue
        verrs = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
        if verrs:
            for ve in verrs:
                path = _json_path(ve.absolute_path)
                msg = ve.message
                if ve.validator == "additionalProperties":
                    msg = f"unknown key ({ve.message})"
                errors.append(src.err(path, msg))
            continue
        if "defaults" in data and "allow" in data["defaults"]:
            default_allow = bool(data["defaults"]["allow"])
        for i, raw in enumerate(data.get("rules") or []):
            path = f"rules[{i}]"
            rid = raw["id"]
            if rid in ids:
                errors.append(src.err(f"{path}.id", f"duplicate rule id {rid!r} (first defined at {ids[rid]})"))
                continue
            ids[rid] = f"{source}:{src.line(path)}"
            r = _compile_rule(raw, len(rules), path, src, errors)
            if r is not None:
                rules.append(r)
        for i, t in enumerate(data.get("tests") or []):
            tests.append((source, src.line(f"tests[{i}]") or 0, t))
    _check_pairs(rules, errors)
    if errors:
        raise PolicyError(errors)
    return rules, tests, default_allow


def load_policies(paths: list[Path], default_allow: bool = True) -> CompiledPolicy:
    """Load and compile policy files (in the given order; directories expand to their sorted *.yaml)."""
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files.extend(sorted(list(p.glob("*.yaml")) + list(p.glob("*.yml"))))
        else:
            files.append(p)
    docs: list[tuple[str, str]] = []
    errors: list[str] = []
    for f in files:
        try:
            docs.append((str(f), f.read_text(encoding="utf-8")))
        except FileNotFoundError:
            errors.append(f"{f}: file not found")
        except (OSError, UnicodeDecodeError) as e:
            errors.append(f"{f}: cannot read: {e}")
    if errors:
        raise PolicyError(errors)
    rules, tests, dflt = parse_documents(docs, default_allow)
    return CompiledPolicy(rules, default_allow=dflt, tests=tests, sources=tuple(str(f) for f in files))


def compile_text(text: str, source: str = "<policy>", default_allow: bool = True) -> CompiledPolicy:
    """Compile one policy document from a string (tests, the admin API)."""
    rules, tests, dflt = parse_documents([(source, text)], default_allow)
    return CompiledPolicy(rules, default_allow=dflt, tests=tests, sources=(source,))
