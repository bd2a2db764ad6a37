"""docs/architecture.md shows the request path as the code declares it: the stage table lists the wired stages in
their order, and the completion table is the completion list (gateway/wiring.py), step for step with its reason.
A change to either list that leaves the doc behind fails here; the fix is in the doc's message."""
from __future__ import annotations

import re
from pathlib import Path

import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import Gateway
from gateway.completion import render_table
from gateway.config import parse_config
from gateway.wiring import wire

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _wired(tmp_path: Path) -> Gateway:
    raw = {"backends": [{"name": "mock", "kind": "openai", "url": "http://127.0.0.1:9/v1", "models": ["m"],
                         "health": {"enabled": False}}],
           "keys": [{"key": "sk-test-" + "x" * 24, "tenant": "t"}],
           "policy": {"audit_path": str(tmp_path / "a.jsonl")},
           "identity": {"sqlite_path": str(tmp_path / "i.db")}, "budgets": {"sqlite_path": str(tmp_path / "b.db")},
           "data_dir": str(tmp_path)}
    gw = Gateway(parse_config(yaml.safe_dump(raw), base_dir=tmp_path))
    wire(gw, span_exporter=InMemorySpanExporter())  # tracing on: every step and stage there is
    return gw


def test_the_completion_table_is_the_completion_list(tmp_path: Path) -> None:
    text = DOC.read_text()
    table = text.split("<!-- completion:begin -->\n", 1)[1].split("\n<!-- completion:end -->", 1)[0]
    want = render_table(_wired(tmp_path).pipeline.completion.steps)
    assert table == want, ("docs/architecture.md's completion table differs from gateway/wiring.py's list; "
                           "paste between the completion markers:\n" + want)


def test_the_stage_table_lists_the_wired_stages_in_order(tmp_path: Path) -> None:
    text = DOC.read_text()
    section = text.split("## The pipeline", 1)[1].split("## Completion", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    wired = [st.name for st in _wired(tmp_path).pipeline.stages] + ["dispatch"]
    assert documented == wired
