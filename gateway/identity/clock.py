"""Where identity reads the time, so that tests can move it by hand instead of sleeping on the wall clock."""
from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """`time()` the wall clock (key expiry and revocation, created_at, a JWT's expiry), `monotonic()` the
    freshness of caches, the failed-auth limiter's windows and the JWKS refresh intervals. The `time` module is
    one; tests pass one they advance."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...
