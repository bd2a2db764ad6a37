"""BatchService's own job lifecycle on a real store: validating -> in_progress -> expired once the completion
window ends, every unanswered line in the error file with batch_expired (the API only offers a 24 h window,
so this drives the service's maintenance step with the clock past it instead of waiting a day)."""
from __future__ import annotations

import json

import orjson
import yaml

from gateway.app import Gateway
from gateway.batch.service import BatchService
from gateway.batch.store import SqliteBatchStore
from gateway.config import parse_config


def _line(i: int) -> str:
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "m", "input": f"text {i}"}})


async def test_an_unfinished_job_ends_expired_with_its_lines_in_the_error_file(tmp_path):
    cfg = parse_config(yaml.safe_dump({"backends": [{"name": "e", "kind": "openai", "url": "http://127.0.0.1:9/v1",
                                                     "models": ["m"]}]}))
    store = SqliteBatchStore(tmp_path / "batch.db")
    svc = BatchService(Gateway(cfg), store=store)
    await store.open()
    await store.migrate()
    try:
        data = ("\n".join(_line(i) for i in range(5)) + "\n").encode()
        await store.insert_file({"id": "file-in", "owner": "o", "tenant": "t", "purpose": "batch",
                                 "filename": "in.jsonl", "bytes": len(data), "created_at": 0.0, "content": data})
        await store.insert_job({"id": "batch_x", "owner": "o", "tenant": "t", "principal": {"id": "p"},
                                "endpoint": "/v1/embeddings", "input_file_id": "file-in", "completion_window": "24h",
                                "created_at": 100.0, "expires_at": 100.0 + 86400})
        await svc._maintain(101.0)
        job = await store.get_job("batch_x")
        assert job["status"] == "in_progress" and job["total"] == 5 and job["in_progress_at"] == 101.0
        (ln,) = await store.claim("batch_x", svc.worker, 102.0, 60.0, 1)
        assert await store.record(ln, svc.worker, True, {"custom_id": ln.custom_id, "response": {}}, 103.0)
        await store.claim("batch_x", svc.worker, 104.0, 60.0, 1)  # still in flight when the window ends
        await svc._maintain(100.0 + 86400)
        job = await store.get_job("batch_x")
        assert job["status"] == "expired" and job["expired_at"] == 100.0 + 86400
        assert job["completed"] == 1 and job["failed"] == 4
        err = [orjson.loads(x) for x in (await store.file_content(job["error_file_id"], "o")).splitlines()]
        assert [e["custom_id"] for e in err] == ["c1", "c2", "c3", "c4"]
        assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in err)
        assert svc.jobs == []  # nothing left to dispatch
    finally:
        await store.close()
