import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI") == "true"


def unavailable(why: str) -> NoReturn:
    """A part the test needs is missing (Redis, Postgres, an engine, a tool): under CI=true that is a failure,
    elsewhere the test is skipped with the reason. Every suite's availability check ends here."""
    if IN_CI:
        pytest.fail(f"{why} (required under CI=true)")
    pytest.skip(why)


def require_service(ok: bool, what: str) -> None:
    """Under CI=true a missing Redis/Postgres/engine is a failure; elsewhere the test is skipped with a reason."""
    if not ok:
        unavailable(f"{what} not reachable")


def require_redis(host: str = "127.0.0.1", port: int = 6379) -> None:
    """The machine's Redis answers PING (a failure under CI=true, else a skip)."""
    import redis

    try:
        ok = bool(redis.Redis(host=host, port=port, socket_timeout=1).ping())
    except redis.RedisError:
        ok = False
    require_service(ok, f"Redis at {host}:{port}")
