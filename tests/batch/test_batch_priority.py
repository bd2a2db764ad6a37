"""End to end: a batch line reaches the engine at the `batch` priority (vLLM priority 10 where the backend runs
priority scheduling) while a realtime request of the same key keeps its own, and an embeddings batch works."""
from __future__ import annotations

import io
import json

import httpx
import pytest

from tests.batch.test_batch_e2e import client, wait_done
from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
KEY = "batch-prio-key-0123456789"


def test_batch_lines_go_upstream_at_batch_priority(tmp_path):
    up, up_port = start_upstream(tmp_path)
    gw = None
    try:
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port},
               "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                             "models": ["mock-model"], "priority_scheduling": True, "location": {"country": "DE"},
                             "capabilities": ["chat", "completions", "embeddings"]}],
               "keys": [{"key": KEY, "tenant": "t"}],
               "identity": {"sqlite_path": str(tmp_path / "gateway.db")},
               "policy": {"audit_path": str(tmp_path / "audit.jsonl")},
               "budgets": {"sqlite_path": str(tmp_path / "budgets.db"), "spool_path": str(tmp_path / "spool.jsonl")},
               "observability": {"log_level": "warning"}}
        (tmp_path / "gateway.yaml").write_text(json.dumps(cfg))
        gw, _ = start_gateway(tmp_path / "gateway.yaml")
        base = f"http://127.0.0.1:{port}"
        stats = lambda: httpx.get(f"http://127.0.0.1:{up_port}/stats").json()  # noqa: E731
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert stats()["last_body"]["priority"] == 5  # standard, the policy default
        c = client(base, KEY)
        data = json.dumps({"custom_id": "only", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "mock-model", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "hi"}]}}).encode()
        f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 1
        assert stats()["last_body"]["priority"] == 10  # routing.priority_values.batch
        emb = "\n".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                    "body": {"model": "mock-model", "input": f"text {i}"}}) for i in range(3))
        f = c.files.create(file=("emb.jsonl", io.BytesIO(emb.encode())), purpose="batch")
        done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 3
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == ["e0", "e1", "e2"]
        assert all(o["response"]["body"]["object"] == "list" for o in out)
    finally:
        if gw is not None:
            gw.stop()
        up.stop()
