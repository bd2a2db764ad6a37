"""The rollout service: the weighted aliases of the current config, their live state (config weights overlaid
by the identity store's rows, polled so replicas and workers agree within `REFRESH_S`), the request stage that
orders an alias's chain by the arm a request's sticky key hashes to, and the rollback watch over outcomes."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.config import Config
from gateway.identity.store import SqlIdentityStore
from gateway.rollouts import arms
from gateway.rollouts.config import AliasTarget, RollbackConfig, ShadowConfig, is_weighted
from gateway.rollouts.rollback import ArmStats, Window, verdict
from gateway.rollouts.store import LiveState, RolloutStore

if TYPE_CHECKING:
    from gateway.identity.service import IdentityService
    from gateway.metrics import Metrics

log = logging.getLogger("gateway.rollouts")
REFRESH_S = 2.0  # a replica reads the store this often: a PATCH or rollback elsewhere applies within it


@dataclass(frozen=True)
class Rollout:
    """One weighted alias as configured."""
    alias: str
    arms: tuple[str, ...]
    config_weights: dict[str, float]
    stable: str
    sticky_header: str | None
    rollback: RollbackConfig
    shadows: tuple[tuple[str, ShadowConfig], ...] = ()  # (model, its shadow settings)


def rollouts_of(config: Config) -> dict[str, Rollout]:
    out: dict[str, Rollout] = {}
    for a in config.raw.aliases:
        if not is_weighted(a.targets):
            continue
        ts = [t for t in a.targets if isinstance(t, AliasTarget) and t.shadow is None]
        shadows = tuple((t.model, t.shadow) for t in a.targets if isinstance(t, AliasTarget) and t.shadow)
        names = tuple(t.model for t in ts)
        cw = {t.model: t.weight for t in ts}
        marked = next((t.model for t in ts if t.stable), None)
        out[a.name] = Rollout(a.name, names, cw, arms.stable_arm(names, cw, marked),
                              a.sticky.header.lower() if a.sticky.header else None, a.rollback, shadows)
    return out


def effective(r: Rollout, live: LiveState | None) -> LiveState:
    """The state a request sees: config weights, overlaid by the live row (arms the row does not name keep their
    config weight; a rolled-back arm weighs 0)."""
    if live is None:
        return LiveState(dict(r.config_weights))
    w = {a: live.weights.get(a, r.config_weights[a]) for a in r.arms}
    rb = {a: why for a, why in live.rolled_back.items() if a in w}
    for a in rb:
        w[a] = 0.0
    return LiveState(w, rb, live.updated_at)


class RolloutService:
    def __init__(self, config: Config, identity: IdentityService | None, metrics: Metrics | None = None) -> None:
        self.rollouts = rollouts_of(config)
        self.identity = identity
        self.metrics = metrics
        self.store: RolloutStore | None = None
        self.live: dict[str, LiveState] = {}
        self.windows: dict[tuple[str, str], Window] = {}
        self.alarms: list[dict[str, Any]] = []  # the latest rollbacks this process saw or made (dashboard)
        self._task: asyncio.Task | None = None
        self._writes: set[asyncio.Task] = set()
        self.shadow_runner: Any = None  # gateway.rollouts.shadow.ShadowRunner, closed with this service

    # ---- lifecycle
    async def start(self) -> None:
        store = self.identity.store if self.identity is not None else None
        if store is None:
            return
        assert isinstance(store, SqlIdentityStore), "the live rollout state needs a SQL identity store"
        self.store = RolloutStore(store)
        await self.store.migrate()
        await self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self.shadow_runner is not None:
            await self.shadow_runner.close()
        for t in [self._task, *self._writes]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): the weighted aliases were validated by load_config."""

    def swap_config(self, config: Config) -> None:
        self.rollouts = rollouts_of(config)

    async def refresh(self) -> None:
        if self.store is not None:
            self.live = await self.store.all()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception as e:  # the store down: keep the last state, try again
                log.warning("rollout state refresh failed: %s", type(e).__name__)

    # ---- reads
    def state(self, alias: str) -> LiveState:
        return effective(self.rollouts[alias], self.live.get(alias))

    def view(self, alias: str, now: float | None = None) -> dict[str, Any]:
        r = self.rollouts[alias]
        st = self.state(alias)
        now = time.monotonic() if now is None else now
        out = []
        for a in r.arms:
            s = self._window(alias, a).stats(now)
            out.append({"model": a, "weight": st.weights[a], "config_weight": r.config_weights[a],
                        "stable": a == r.stable, "rolled_back": st.rolled_back.get(a),
                        "window": {"requests": s.requests, "errors": s.errors, "error_rate": s.error_rate,
                                   "ttft_p90_s": s.ttft_p90_s}})
        return {"alias": alias, "arms": out, "sticky_header": r.sticky_header,
                "rollback": msgspec.structs.asdict(r.rollback),
                "live": alias in self.live, "updated_at": st.updated_at or None}

    # ---- writes (admin)
    async def set_weights(self, alias: str, weights: dict[str, float]) -> LiveState:
        st = self.state(alias)
        new = LiveState({**st.weights, **weights}, {a: w for a, w in st.rolled_back.items() if a not in weights})
        return await self._put(alias, new)

    async def reset(self, alias: str) -> None:
        """Back to the config's weights, no arm rolled back."""
        if self.store is not None:
            await self.store.delete(alias)
        self.live.pop(alias, None)
        for a in self.rollouts[alias].arms:
            self.windows.pop((alias, a), None)

    async def _put(self, alias: str, st: LiveState) -> LiveState:
        if self.store is None:
            raise RuntimeError("no identity store")
        saved = await self.store.put(alias, st)
        self.live[alias] = saved
        return saved

    # ---- the request path
    def order(self, alias: str, key: str) -> tuple[str, ...]:
        r = self.rollouts[alias]
        return arms.chain(r.arms, self.state(alias).weights, arms.unit(alias, key))

    def observe(self, alias: str, arm: str, ok: bool, ttft_s: float | None, now: float | None = None) -> str | None:
        """Record one outcome of `arm`; roll it back when it regresses against the stable arm (the reason)."""
        r = self.rollouts.get(alias)
        if r is None or arm not in r.arms:
            return None
        now = time.monotonic() if now is None else now
        self._window(alias, arm).add(now, ok, ttft_s)
        if arm == r.stable or arm in self.state(alias).rolled_back:
            return None
        why = verdict(self._window(alias, arm).stats(now), self._window(alias, r.stable).stats(now), r.rollback)
        if why is not None:
            self._roll_back(alias, arm, why)
        return why

    def _window(self, alias: str, arm: str) -> Window:
        w = self.windows.get((alias, arm))
        if w is None:
            w = self.windows[(alias, arm)] = Window(self.rollouts[alias].rollback.window_s)
        return w

    def _roll_back(self, alias: str, arm: str, why: str) -> None:
        st = self.state(alias)
        new = LiveState({**st.weights, arm: 0.0}, {**st.rolled_back, arm: why}, time.time())
        self.live[alias] = new  # at once in this process; the store write follows
        log.warning("rollout %s: arm %s rolled back (weight 0): %s", alias, arm, why)
        self.alarms = [*self.alarms[-19:], {"alias": alias, "arm": arm, "reason": why, "ts": time.time()}]
        if self.metrics is not None:
            self.metrics.rollout_rollbacks.labels(alias, arm).inc()
        if self.store is not None:
            t = asyncio.get_running_loop().create_task(self._persist(alias, arm, why, st))
            self._writes.add(t)
            t.add_done_callback(self._writes.discard)

    async def _persist(self, alias: str, arm: str, why: str, before: LiveState) -> None:
        """Store the rollback; where another replica rolled the arm back first, its reason is the one kept, and
        this process takes the stored state at once rather than at its next refresh."""
        assert self.store is not None
        try:
            self.live[alias] = await self.store.roll_back(alias, arm, why, before)
        except Exception as e:
            log.error("rollout %s: the rollback could not be stored (%s); this process keeps it", alias,
                      type(e).__name__)

    def stats(self, alias: str, arm: str, now: float) -> ArmStats:
        return self._window(alias, arm).stats(now)
