"""End to end: a gateway killed with SIGKILL in the middle of a batch resumes it on restart, and every line is
delivered exactly once (no custom_id lost, none twice), through the official `openai` SDK."""
from __future__ import annotations

import io
import json
import sqlite3
import time

import pytest

from backends.sim.fleet import FleetProcess
from tests.batch.test_batch_e2e import client, lines, new_key, wait_done, write_config
from tests.support.procs import free_port, start_gateway

pytestmark = pytest.mark.e2e
N = 200


def test_sigkill_mid_batch_resumes_exactly_once(tmp_path):
    fleet = FleetProcess(["--engines", "2", "--profile", "h200-8b", "--base-port", "0"], tmp_path / "fleet.json")
    man = fleet.start()
    gw = None
    try:
        port = free_port()
        cfg = write_config(tmp_path, man["engines"], port, {"batch": {"lease_s": 1.0, "max_concurrency": 16}})
        gw, _ = start_gateway(cfg)
        base = f"http://127.0.0.1:{port}"
        _, key = new_key(base, "crash")
        c = client(base, key)
        f = c.files.create(file=("in.jsonl", io.BytesIO(lines(N, "crash test " * 20, max_tokens=200))), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while True:
            got = c.batches.retrieve(b.id)
            if got.request_counts.completed >= 40:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.02)
        gw.kill()  # SIGKILL to the process group: no shutdown, leases and in-flight lines left as they were
        db = sqlite3.connect(tmp_path / "batch.db")
        before = dict(db.execute("SELECT state, COUNT(*) FROM batch_lines WHERE batch_id = ? GROUP BY state",
                                 (b.id,)).fetchall())
        db.close()
        assert before.get("pending", 0) > 0 and before.get("leased", 0) > 0, before  # really mid-batch, mid-line
        gw, _ = start_gateway(cfg)
        done = wait_done(c, b.id, 120)
        assert done.status == "completed", done
        assert done.request_counts.total == N and done.request_counts.completed == N and done.request_counts.failed == 0
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        ids = [o["custom_id"] for o in out]
        assert len(ids) == N and set(ids) == {f"req-{i}" for i in range(N)}  # none lost, none twice
        assert all(o["response"]["status_code"] == 200 for o in out)
        db = sqlite3.connect(tmp_path / "batch.db")
        redone = db.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND dispatches > 1",
                            (b.id,)).fetchone()[0]
        db.close()
        print(f"\nkilled with {before}; lines dispatched again after the restart: {redone}")
        assert redone <= before.get("leased", 0)  # only lines in flight at the kill ran again
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
