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
