"""Fixtures for the budget tests: real Redis (6379), real Postgres (db `test`), a config builder.

Missing servers skip locally and FAIL under CI=true, as the project rules require.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gateway.config import parse_config
from tests.conftest import require_service

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def redis_url() -> str:
    require_service(_port_open(6379), "Redis at 127.0.0.1:6379")
    return REDIS_URL


@pytest.fixture
def pg_dsn() -> str:
    require_service(_port_open(5432), "Postgres at 127.0.0.1:5432")
    return PG_DSN


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix so tests never see each other's counters in the shared Redis."""
    return f"gwbtest:{uuid.uuid4().hex[:10]}"


def make_config(tmp_path: Path, **budgets) -> object:
    import yaml

    text = yaml.safe_dump({"budgets": budgets, "data_dir": str(tmp_path)})
    return parse_config(text, "test.yaml", base_dir=tmp_path)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class RedisServer:
    """A private redis-server (never the shared 6379) with AOF fsync always, restartable on the same port."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        require_service(exe is not None, "redis-server binary")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while not _port_open(self.port):
            if time.time() > deadline:
                raise RuntimeError("private redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path):
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()
