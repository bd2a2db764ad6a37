"""The routing plugin registry: plugin classes by `type` name, presets, and strategies built from config.

Every module of `gateway.routing.filters`, `.scorers` and `.pickers` is imported on first use (pkgutil), and
each registers its class with `@register("type_name")`; so a new plugin is one file (and its test), with no
list to edit. `routing.strategy` is either a preset name (`PRESETS`) or a list of `{type, weight, params}`
entries; `strategy_error` is the validation gateway.config reports with file:line, `build_strategy` builds.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
from typing import Any, Callable, Sequence, TypeVar

from gateway.routing.plugin import Plugin, Strategy

PACKAGES = ("gateway.routing.filters", "gateway.routing.scorers", "gateway.routing.pickers")
KINDS = ("filter", "scorer", "picker")
DEFAULT_PICKER = "min_score"

_REGISTRY: dict[str, type[Plugin]] = {}
_loaded = False

P = TypeVar("P", bound=type[Plugin])


def register(type_name: str) -> Callable[[P], P]:
    """Class decorator: make the plugin class available as `type: <type_name>` in `routing.strategy`."""

    def deco(cls: P) -> P:
        if cls.kind not in KINDS:
            raise TypeError(f"{cls.__name__}: kind must be one of {KINDS}, got {cls.kind!r}")
        have = _REGISTRY.get(type_name)
        if have is not None and have is not cls:
            raise ValueError(f"routing plugin type {type_name!r} registered twice ({have.__name__}, {cls.__name__})")
        cls.type = type_name
        _REGISTRY[type_name] = cls
        return cls

    return deco


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if not m.name.startswith("_"):
                importlib.import_module(f"{pkg_name}.{m.name}")
    _loaded = True


def plugin_types() -> dict[str, type[Plugin]]:
    """Every registered plugin class by type name."""
    _load()
    return dict(_REGISTRY)


def plugin_class(type_name: str) -> type[Plugin]:
    _load()
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise ValueError(f"unknown routing plugin type {type_name!r}") from None


# ------------------------------------------------------------------------------------------------ presets

def presets(affinity_slack_ms: float = 15.0, affinity_rel: float = 0.1) -> dict[str, list[dict[str, Any]]]:
    """Today's strategy names as plugin lists (the affinity slack of the predicted presets comes from
    `routing.affinity_slack_ms` / `affinity_rel`)."""
    aff = {"affinity_slack_ms": affinity_slack_ms, "affinity_rel": affinity_rel}
    return {
        "predicted_ttft": [{"type": "capacity"}, {"type": "predicted_ttft"}, {"type": "min_score", "params": aff}],
        "least_loaded": [{"type": "capacity"}, {"type": "load"}, {"type": "min_score"}],
        "round_robin": [{"type": "capacity"}, {"type": "round_robin"}],
        "prefix_hash": [{"type": "capacity"}, {"type": "prefix_hash"}, {"type": "min_score"}],
        "target_fit": [{"type": "capacity"}, {"type": "target_fit"}, {"type": "min_score", "params": aff}],
    }


PRESETS = tuple(presets())


# ------------------------------------------------------------------------------------------------ validation

def _entry(e: Any) -> tuple[str, float | None, dict[str, Any]]:
    """(type, weight, params) of a config entry: a RoutingConfig PluginSpec or a plain mapping."""
    if isinstance(e, dict):
        return e.get("type", ""), e.get("weight"), dict(e.get("params") or {})
    return e.type, e.weight, dict(e.params or {})


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def entry_error(e: Any) -> tuple[str, str] | None:
    """(key under the entry, why) for a strategy entry that cannot be built, else None."""
    type_name, weight, params = _entry(e)
    types = plugin_types()
    cls = types.get(type_name)
    if cls is None:
        return "type", f"unknown plugin type {type_name!r}; known: {', '.join(sorted(types))}"
    if weight is not None:
        if cls.kind != "scorer":
            return "weight", f"only scorers take a weight ({type_name!r} is a {cls.kind})"
        w = _number(weight)
        if w is None or not math.isfinite(w) or w < 0:
            return "weight", f"must be a finite number >= 0 (got {weight!r})"
    for k, v in params.items():
        spec = cls.params.get(k)
        if spec is None:
            allowed = ", ".join(sorted(cls.params)) or "none"
            return f"params.{k}", f"unknown param for {type_name!r} (it takes: {allowed})"
        x = _number(v)
        if x is None or not spec.check(x):
            return f"params.{k}", f"{spec.rule} (got {v!r})"
    return None


def strategy_error(strategy: str | Sequence[Any]) -> tuple[str, str] | None:
    """(key under `routing.`, why) for a `routing.strategy` that cannot be built, else None."""
    if isinstance(strategy, str):
        if strategy not in PRESETS:
            return "strategy", f"must be a list of plugins or one of {', '.join(PRESETS)} (got {strategy!r})"
        return None
    if not strategy:
        return "strategy", f"an empty list routes nothing: list plugins or name a preset ({', '.join(PRESETS)})"
    pickers = []
    for i, e in enumerate(strategy):
        bad = entry_error(e)
        if bad is not None:
            return f"strategy[{i}].{bad[0]}", bad[1]
        if plugin_types()[_entry(e)[0]].kind == "picker":
            pickers.append(i)
    if len(pickers) > 1:
        return f"strategy[{pickers[1]}]", "a strategy has one picker (another is at " \
                                          f"strategy[{pickers[0]}])"
    return None


# ------------------------------------------------------------------------------------------------ building

def build_plugin(e: Any) -> Plugin:
    """One plugin instance from an entry (ValueError naming the key when the entry cannot be built)."""
    bad = entry_error(e)
    if bad is not None:
        raise ValueError(f"{bad[0]}: {bad[1]}")
    type_name, weight, params = _entry(e)
    cls = plugin_class(type_name)
    p = cls(**{k: float(v) for k, v in params.items()})  # type: ignore[call-arg]
    if cls.kind == "scorer":
        p.weight = 1.0 if weight is None else float(weight)  # type: ignore[attr-defined]
    return p


def build_strategy(spec: str | Sequence[Any], affinity_slack_ms: float = 15.0, affinity_rel: float = 0.1,
                   name: str | None = None) -> Strategy:
    """The strategy for a `routing.strategy` value: a preset name or a list of entries (raises ValueError
    naming the entry when it cannot be built)."""
    entries: list[Any]
    if isinstance(spec, str):
        preset = presets(affinity_slack_ms, affinity_rel).get(spec)
        if preset is None:
            raise ValueError(f"unknown routing strategy {spec!r}")
        entries, label = list(preset), spec
    else:
        entries = list(spec)
        label = name or strategy_label(entries)
    bad = strategy_error(entries)
    if bad is not None:
        raise ValueError(f"routing.{bad[0]}: {bad[1]}")
    plugins = [build_plugin(e) for e in entries]
    pickers = [p for p in plugins if p.kind == "picker"]
    picker = pickers[0] if pickers else plugin_class(DEFAULT_PICKER)()
    return Strategy(label, [p for p in plugins if p.kind == "filter"], [p for p in plugins if p.kind == "scorer"],
                    picker)


def strategy_label(strategy: str | Sequence[Any]) -> str:
    """A short text naming a strategy (evidence `route.strategy`, /admin/routing): the preset name, or the
    entries' types with their weights, e.g. `capacity,predicted_ttft*1,load*20,min_score`."""
    if isinstance(strategy, str):
        return strategy
    out = []
    for e in strategy:
        t, w, _ = _entry(e)
        cls = plugin_types().get(t)
        out.append(f"{t}*{1.0 if w is None else w:g}" if cls is not None and cls.kind == "scorer" else t)
    return ",".join(out)
