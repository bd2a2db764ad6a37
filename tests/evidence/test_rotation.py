"""Audit JSON lines rotated by size (policy.audit_max_bytes / audit_backups) with no record lost or split, and
to stdout (policy.audit_path: "-")."""
from __future__ import annotations

import orjson
import pytest

from gateway.app import Gateway
from gateway.config import ConfigError, parse_config
from gateway.evidence.recorder import EvidenceRecorder
from gateway.wiring import wire

from .test_recorder import finished_ctx


def lines(p) -> list[dict]:
    return [orjson.loads(ln) for ln in p.read_bytes().splitlines()] if p.exists() else []


async def test_rotation_by_size_loses_no_record(tmp_path):
    path = tmp_path / "audit.jsonl"
    probe = EvidenceRecorder(tmp_path / "probe.jsonl", linger_s=0)
    await probe.start()
    probe.record(await finished_ctx("probe", None))
    await probe.close()
    one = (tmp_path / "probe.jsonl").stat().st_size
    limit = one * 3 + one // 2  # three records fit, a fourth does not
    rec = EvidenceRecorder(path, linger_s=0, batch=2, max_bytes=limit, backups=100)
    await rec.start()
    ids = [f"r-{i:03d}" for i in range(40)]
    for rid in ids:
        assert rec.record(await finished_ctx(rid, None))
    await rec.close()
    files = [path, *sorted(tmp_path.glob("audit.jsonl.*"), key=lambda p: int(p.suffix[1:]))]  # newest first
    assert rec.rotations >= 10 and len(files) == rec.rotations + 1
    # every record exactly once, in order, oldest file first; no file over the limit (each batch fits in it)
    got = [r["request_id"] for p in reversed(files) for r in lines(p)]
    assert got == ids
    assert all(p.stat().st_size <= limit for p in files)

    # a record that now lives in a rotated file is still found after a restart (memory empty)
    fresh = EvidenceRecorder(path, recent=1, max_bytes=limit, backups=100)
    assert (await fresh.get("r-000"))["request_id"] == "r-000"
    assert (await fresh.get("r-039"))["request_id"] == "r-039"


async def test_rotation_keeps_at_most_audit_backups_files(tmp_path):
    path = tmp_path / "audit.jsonl"
    rec = EvidenceRecorder(path, linger_s=0, batch=1, max_bytes=1, backups=2)  # every write rotates
    await rec.start()
    for i in range(5):
        assert rec.record(await finished_ctx(f"k-{i}", None))
    await rec.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".audit.jsonl.lock", "audit.jsonl", "audit.jsonl.1",
                                                          "audit.jsonl.2"]  # the lock: see test_workers_share_...
    assert [r["request_id"] for p in (path.with_name("audit.jsonl.2"), path.with_name("audit.jsonl.1"), path)
            for r in lines(p)] == ["k-2", "k-3", "k-4"]


async def test_audit_to_stdout(tmp_path, capfd):
    rec = EvidenceRecorder("-", linger_s=0)
    await rec.start()
    for i in range(3):
        assert rec.record(await finished_ctx(f"s-{i}", None))
    await rec.close()
    out = capfd.readouterr().out
    assert [orjson.loads(ln)["request_id"] for ln in out.splitlines()] == ["s-0", "s-1", "s-2"]
    assert not list(tmp_path.iterdir())  # no file named "-" anywhere
    assert (await rec.get("s-1"))["request_id"] == "s-1"  # from memory; there is no file to scan


def test_config_wires_stdout_and_rotation_and_refuses_rotation_without_backups(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = 'backends: [{name: a, url: "http://127.0.0.1:9/v1", models: [m]}]\n'
    gw = Gateway(parse_config(base + 'policy: {audit_path: "-"}\n'))
    wire(gw)
    assert gw.evidence.stdout and gw.evidence.path is None
    gw = Gateway(parse_config(base + "policy: {audit_path: a.jsonl, audit_max_bytes: 1000000, audit_backups: 3}\n"))
    wire(gw)
    assert gw.evidence.max_bytes == 1000000 and gw.evidence.backups == 3 and gw.evidence.path.name == "a.jsonl"
    with pytest.raises(ConfigError, match="policy.audit_backups"):
        parse_config(base + "policy: {audit_max_bytes: 1000, audit_backups: 0}\n")
    with pytest.raises(ConfigError, match="policy.audit_max_bytes"):
        parse_config(base + "policy: {audit_max_bytes: -1}\n")


def _hammer(path: str, tag: str, n: int, max_bytes: int) -> None:
    rec = EvidenceRecorder(path, max_bytes=max_bytes, backups=10_000)
    for i in range(n):
        rec._append(orjson.dumps({"request_id": f"{tag}-{i:04d}", "pad": "x" * 200}) + b"\n")


def test_workers_share_one_file_and_its_rotation_without_losing_a_record(tmp_path):
    """`gateway serve --workers N`: N processes append to one audit path with rotation by size; every record
    lands exactly once, whole, and no file passes the limit (two processes rotating at once used to rename the
    other's fresh file away or fail on a path that had just been renamed, losing that batch)."""
    import multiprocessing as mp

    path = tmp_path / "audit.jsonl"
    limit = 2_000  # ~8 records a file: rotations all the time
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_hammer, args=(str(path), f"w{w}", 400, limit)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = [path, *tmp_path.glob("audit.jsonl.*")]
    got = [r["request_id"] for p in files for r in lines(p)]
    assert sorted(got) == sorted(f"w{w}-{i:04d}" for w in range(3) for i in range(400))
    assert all(p.stat().st_size <= limit for p in files)
