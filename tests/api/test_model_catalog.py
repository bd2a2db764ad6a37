"""/v1/models entries carry `context_length` (the field OpenRouter-style aggregators read) next to
`context_window`: the smallest window of the serving backends, for a model and for an alias over models."""
from __future__ import annotations

from gateway.app import model_catalog
from gateway.config import parse_config

CFG = """
backends:
  - {name: a, url: "http://127.0.0.1:9/v1", models: [big, small], context_window: 32768}
  - {name: b, url: "http://127.0.0.1:8/v1", models: [big], context_window: 8192}
  - {name: c, url: "http://127.0.0.1:7/v1", models: [open]}
aliases:
  - {name: any, targets: [big, small]}
  - {name: unknown-window, targets: [open]}
"""


def test_context_length_is_the_smallest_window_of_the_serving_backends():
    entries = {e["id"]: e for e in model_catalog(parse_config(CFG))}
    assert entries["big"]["context_length"] == entries["big"]["context_window"] == 8192
    assert entries["small"]["context_length"] == 32768
    assert entries["any"]["context_length"] == 8192  # an alias: the smallest over its targets
    assert entries["open"]["context_length"] is None and entries["unknown-window"]["context_length"] is None
