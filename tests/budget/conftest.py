"""Fixtures for the budget tests: real Redis (6379), real Postgres (db `test`), a config builder.

Missing servers skip locally and FAIL under CI=true, as the project rules require.
"""
from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from gateway.budget.model import ReserveArgs, ScopePlan, SettleArgs, WindowPlan, by_counted, by_held
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


def window_plan(window: str, key: str, rolling: bool, bucket: int = 0, buckets: int = 0, bucket_s: int = 0,
                end: float = math.inf, ttl_s: int = 0, tokens: int | None = None, money: int | None = None,
                requests: int | None = None, gpu: int | None = None) -> WindowPlan:
    """A WindowPlan with its limits in store units by dimension (None: counted only)."""
    lim = {"tokens": tokens, "money": money, "requests": requests, "gpu_seconds": gpu}
    return WindowPlan(window, key, rolling, bucket, buckets, bucket_s, end, ttl_s, by_counted(lim))


def reserve_args(rid: str, now: float, expires: float, hold_ttl_s: int, prompt: int, prompt_money: int, maxc: int,
                 minc: int, money_per_token: int, scopes: tuple[ScopePlan, ...], fixed_gpu: int = 0,
                 gpu_per_token: int = 0) -> ReserveArgs:
    """A reservation of `prompt` tokens + 1 per completion token, its money and GPU-seconds (store units)."""
    return ReserveArgs(rid, now, expires, hold_ttl_s, maxc, minc, scopes,
                       fixed=by_held({"tokens": prompt, "money": prompt_money, "gpu_seconds": fixed_gpu}),
                       per_token=by_held({"tokens": 1, "money": money_per_token, "gpu_seconds": gpu_per_token}))


def settle_args(rid: str, now: float, tokens: int, money: int, scopes: tuple[ScopePlan, ...], done_key: str = "",
                done_ttl_s: int = 0, gpu: int = 0) -> SettleArgs:
    return SettleArgs(rid, now, by_held({"tokens": tokens, "money": money, "gpu_seconds": gpu}), scopes, done_key,
                      done_ttl_s)


def flat_scopes(flat: list, args: ReserveArgs) -> list:
    """A store's flat reserve reply decoded by hand (not by ReserveResult.from_flat, which the stores' replies
    are compared through): per scope [held tokens, held money, holds, held GPU, [(requests, tokens, money,
    oldest bucket, GPU) per window]]. The layout: per scope its holds and a sum per held dimension, per window a
    sum per counted dimension and its oldest bucket (gateway/budget/model.py)."""
    from gateway.budget.dimensions import COUNTED, HELD

    held_names = [d.name for d in HELD]
    counted = [d.name for d in COUNTED]
    i = 5
    out = []
    for s in args.scopes:
        held = dict(zip(held_names, flat[i + 1:i + 1 + len(held_names)]))
        row = [held["tokens"], held["money"], flat[i], held["gpu_seconds"], []]
        i += 1 + len(held_names)
        for _ in s.windows:
            used = dict(zip(counted, flat[i:i + len(counted)]))
            row[4].append((used["requests"], used["tokens"], used["money"], flat[i + len(counted)],
                           used["gpu_seconds"]))
            i += len(counted) + 1
        out.append(row)
    return out


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
