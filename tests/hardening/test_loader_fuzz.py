"""Fuzz the YAML config and policy loaders with hypothesis: random text, random structures and mutations of
valid documents only ever raise ConfigError / PolicyError (a clear message), never another exception; alias
bombs and deep nesting are refused in bounded time and memory."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import ConfigError, parse_config
from gateway.policy.compiler import PolicyError, compile_text

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID_CONFIG: dict[str, Any] = {
    "server": {"host": "127.0.0.1", "port": 18090, "max_body_bytes": 100000},
    "backends": [
        {"name": "a", "kind": "sim", "url": "http://127.0.0.1:1/v1", "models": ["m"], "location": {"country": "DE"},
         "retention": "zero", "timeouts": {"connect_s": 1, "total_s": 10}, "health": {"enabled": False}},
        {"name": "b", "kind": "openai", "url": "http://127.0.0.1:2/v1", "models": ["m", "n"],
         "location": {"country": "US"}, "api_key_env": "HOME", "model_map": {"n": "vendor/n"}},
    ],
    "aliases": [{"name": "al", "targets": ["m", "n"]}],
    "keys": [{"key": "k-0123456789", "tenant": "t", "labels": {"residency": "eea"}, "models": ["m"]}],
    "admin": {"key": "admin-0123456789"},
    "budgets": {"prices": {"m": {"input": 1.0, "output": 2.0, "currency": "EUR"}}},
}
VALID_POLICY = (ROOT / "policies" / "tenants.yaml").read_text()


def _config_ok(text: str) -> None:
    try:
        parse_config(text, "fuzz.yaml", base_dir=ROOT)
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml"), str(e)  # names the file


def _policy_ok(text: str) -> None:
    try:
        compile_text(text, "fuzz-policy.yaml")
    except PolicyError as e:
        assert str(e), "empty policy error"


def test_seeds_are_valid():
    parse_config(yaml.safe_dump(VALID_CONFIG), "fuzz.yaml", base_dir=ROOT)
    compile_text(VALID_POLICY, "tenants.yaml")


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                         st.text(max_size=20), st.sampled_from(["", "~", "EEA", "zero", "DE", "1 EUR", "10s", "*"]))
yaml_values = st.recursive(yaml_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), c, max_size=4)),
                           max_leaves=25)


@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    _config_ok(text)
    _policy_ok(text)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_decoded_leniently(data):
    text = data.decode("utf-8", errors="replace")
    _config_ok(text)
    _policy_ok(text)


@FUZZ
@given(yaml_values)
def test_random_structures(value):
    text = yaml.safe_dump(value)
    _config_ok(text)
    _policy_ok(text)


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, prefix + (i,))
    return out


def _mutate(doc: Any, data) -> Any:
    """Replace one subtree of a valid document with a random value (or delete a key)."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = data.draw(yaml_values)
        except (KeyError, IndexError, TypeError):
            continue
    return doc


@FUZZ
@given(st.data())
def test_mutated_valid_config(data):
    _config_ok(yaml.safe_dump(_mutate(VALID_CONFIG, data)))


@FUZZ
@given(st.data())
def test_mutated_valid_policy(data):
    _policy_ok(yaml.safe_dump(_mutate(yaml.safe_load(VALID_POLICY), data)))


def _laughs(levels: int, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text", [
    _laughs(9),  # 9**10 nodes if expanded
    "server: &s {host: x}\nbackends: [" + ", ".join(["*s"] * 2000) + "]\n",
    "a: &a [*a]\n",  # self-reference is a composer error
    "a: " + "[" * 20000 + "]" * 20000,
    "a: " + "{b: " * 5000 + "1" + "}" * 5000,
    "- " * 5000 + "x",
    "? [a, b]\n: 1\n",  # non-scalar key
    "!!python/object/apply:os.system ['true']",
    "a: !!binary 'not base64!'",
    "a: 1\na: 2\n",
    "\x00\x01",
    "a: 1e99999\n",
    "port: 99999999999999999999999999999\n",
])
def test_hostile_yaml_is_a_clear_error(text):
    _config_ok(text)
    _policy_ok(text)


def test_alias_bomb_is_refused_not_expanded():
    with pytest.raises(ConfigError, match="expands to more than"):
        parse_config(_laughs(9), "bomb.yaml")
    with pytest.raises(PolicyError, match="expands to more than"):
        compile_text(_laughs(9), "bomb.yaml")
