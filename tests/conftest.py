import os

import pytest

IN_CI = os.environ.get("CI") == "true"


def require_service(ok: bool, what: str) -> None:
    """Under CI=true a missing Redis/Postgres/engine is a failure; elsewhere the test is skipped with a reason."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is not reachable")
    pytest.skip(f"{what} not reachable")
