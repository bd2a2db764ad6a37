"""Placement of registered adapters on engines that load LoRA adapters at run time (`backends[].lora.dynamic`).

Pure decisions first (no I/O; tests/adapters/test_placement.py): which engines a registered adapter may run on
(`dynamic_backends`), what serving it on one engine takes (`step`: resident, load, load after unloading the least
recently used idle adapter, or nothing when every slot has requests in flight), and the order to try the engines
in (`choose`: resident first, else the lowest predicted TTFT plus the engine's learned load time).

Then `Placement`, the I/O: the dispatcher asks it to order an adapter request's candidates and to make the adapter
resident on the engine before each attempt (one lock per engine, so concurrent requests never load twice); it
loads with vLLM's `POST /v1/load_lora_adapter`, unloads with `/v1/unload_lora_adapter`, learns each engine's load
time (EWMA), counts requests in flight per (engine, adapter) until the pipeline finishes the request, and re-reads
what an engine holds from its `/v1/models` every `lora.refresh_s` and after a 404 for an adapter it believed loaded.
State is this process's own: replicas (and `server.workers` > 1) do not share it yet (docs/adapters.md).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping, NamedTuple

import httpx
import msgspec
from prometheus_client import Counter

from gateway.adapters.holds import SharedHolds
from gateway.config import BackendConfig, Config
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.routing.plan import Candidate
from gateway.telemetry.scraper import EngineLoad, parse_metrics

DEFAULT_LOAD_S = 0.5  # the prior for an engine's load time until a load was measured
LOAD_EWMA = 0.3  # weight of the newest measured load
log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 60.0
ENGINE_FRESH_S = 5.0  # an engine's scraped adapter state older than this is not acted on


# ------------------------------------------------------------------------------------------------ pure part


def is_dynamic(b: BackendConfig) -> bool:
    return b.lora is not None and b.lora.dynamic


def load_aware(b: BackendConfig) -> bool:
    return b.lora is None or b.lora.choice == "predicted"


def dynamic_backends(config: Config, base_model: str) -> list[BackendConfig]:
    """The engines that may load an adapter of `base_model`: dynamic ones serving that base model."""
    return [b for b in config.backends if is_dynamic(b) and base_model in b.models]


def as_adapter_backend(b: BackendConfig, adapter: str) -> BackendConfig:
    """The engine as a candidate for the adapter: it serves the adapter's name as a LoRA adapter (so the KV index
    keys its blocks by that name, gateway/routing/prompt.py::lora_name)."""
    return msgspec.structs.replace(b, models=[*b.models, adapter], lora_adapters=[*b.lora_adapters, adapter])


@dataclass
class Slots:
    """One engine's adapter slots as the gateway believes them."""

    max_loras: int
    resident: dict[str, float] = field(default_factory=dict)  # adapter -> when last used (monotonic)
    inflight: dict[str, int] = field(default_factory=dict)  # adapter -> requests in flight on this engine
    load_s: float | None = None  # learned load time (EWMA); None until one was measured
    # adapters with requests running or waiting in the engine as it reports them (vllm:lora_requests_info) or
    # held by another replica (the shared holds): never unloaded, whoever sent those requests
    others: frozenset[str] = frozenset()
    released: dict[str, float] = field(default_factory=dict)  # adapter -> when our last hold ended (wall clock)
    loading: dict[str, "asyncio.Task[None]"] = field(default_factory=dict)  # loads under way (slot taken)

    def busy(self, adapter: str) -> bool:
        return self.inflight.get(adapter, 0) > 0 or adapter in self.others


class Step(NamedTuple):
    """What serving an adapter on one engine takes: load it or not, and which adapter to unload first."""

    load: bool
    evict: str | None = None


def lru_idle(resident: Mapping[str, float], inflight: Mapping[str, int],
             others: frozenset[str] = frozenset()) -> str | None:
    """The least recently used resident adapter with no request in flight (ours, or `others`: the engine's or
    another replica's), or None when all are busy."""
    idle = [(t, n) for n, t in resident.items() if inflight.get(n, 0) <= 0 and n not in others]
    return min(idle)[1] if idle else None


def step(adapter: str, s: Slots) -> Step | None:
    """Resident: nothing to do. A free slot: load. Full: load after unloading the LRU idle adapter. Every slot
    busy with requests in flight: None (the engine cannot take the adapter now)."""
    if adapter in s.resident:
        return Step(False)
    if len(s.resident) < s.max_loras:
        return Step(True)
    victim = lru_idle(s.resident, s.inflight, s.others | frozenset(s.loading))
    return None if victim is None else Step(True, victim)


def load_cost_s(s: Slots, prior_s: float) -> float:
    return s.load_s if s.load_s is not None else prior_s


def cost_s(st: Step, ttft_s: float, load_s: float, load_aware: bool = True) -> float:
    """What serving the request on an engine costs, in seconds to its first token: the engine's predicted TTFT,
    plus the load when the adapter is not resident, plus one more load when an idle adapter must be unloaded for
    it (whoever needs that one next loads it again). `load_aware=False` is the ablation that routes as if every
    adapter were resident everywhere (load on miss; `lora.choice: ignore_load`)."""
    if not load_aware or not st.load:
        return ttft_s
    return ttft_s + load_s + (load_s if st.evict is not None else 0.0)


def choose(adapter: str, engines: Iterable[tuple[str, float | None]], slots: Mapping[str, Slots],
           prior_s: float = DEFAULT_LOAD_S, load_aware: bool = True) -> list[tuple[str, Step]]:
    """The engines to try for `adapter`, best first, each with its step. `engines` are (name, predicted TTFT in
    seconds without any load, or None where the engine is not modelled: then 0). Order: the lowest `cost_s`, so
    a resident engine is kept while its predicted wait is shorter than a load elsewhere, and a hot adapter spreads
    to a second engine exactly when loading it there is predicted to beat waiting (ties: resident, then a free
    slot, then config order). Engines whose slots are all busy with requests in flight are left out."""
    ranked: list[tuple[float, bool, bool, int, str, Step]] = []
    for i, (name, ttft) in enumerate(engines):
        s = slots[name]
        st = step(adapter, s)
        if st is None:
            continue
        c = cost_s(st, ttft or 0.0, load_cost_s(s, prior_s), load_aware)
        ranked.append((c, st.load, st.evict is not None, i, name, st))
    return [(n, st) for *_, n, st in sorted(ranked)]


def learn_load(prev: float | None, measured_s: float) -> float:
    return measured_s if prev is None else (1 - LOAD_EWMA) * prev + LOAD_EWMA * measured_s


def mean_load(slots: Iterable[Slots]) -> float:
    """The prior for an engine never measured: the mean of the others' learned load times, else DEFAULT_LOAD_S."""
    seen = [s.load_s for s in slots if s.load_s is not None]
    return sum(seen) / len(seen) if seen else DEFAULT_LOAD_S


def adapter_ids(models_body: Any, base_models: Iterable[str]) -> set[str]:
    """The adapters an engine's /v1/models lists (vLLM: a card with a `parent` is a LoRA adapter)."""
    bases = set(base_models)
    data = models_body.get("data") if isinstance(models_body, dict) else None
    out = set()
    for c in data if isinstance(data, list) else ():
        if isinstance(c, dict) and isinstance(c.get("id"), str) and (c.get("parent") or c["id"] not in bases):
            out.add(c["id"])
    return out


def not_loaded_answer(status: int, upstream_message: str | None, adapter: str) -> bool:
    """Is an engine's answer vLLM's 404 for a model (adapter) it does not serve?"""
    if status != 404:
        return False
    msg = upstream_message or ""
    return not msg or "does not exist" in msg or adapter in msg


# ------------------------------------------------------------------------------------------------ I/O part


def _retrieved(task: "asyncio.Task[None]") -> None:
    """A load's failure is raised to the requests that wait for it; one nobody waited for is not an error."""
    if not task.cancelled():
        task.exception()


class PlacementMetrics:
    def __init__(self, registry: Any) -> None:
        self.ops = Counter("gateway_adapter_placements_total", "LoRA adapter loads and unloads the gateway made, "
                           "per engine", ["backend", "op"], registry=registry)


class Placement:
    """Where registered adapters are resident, and the loads/unloads that change it (see the module doc)."""

    name = "adapter_placement"  # a pipeline stage too: its finish ends the request's hold on its adapter

    def __init__(self, config: Callable[[], Config], auth_headers: Callable[[BackendConfig], dict[str, str]],
                 sources: Callable[[], Awaitable[Mapping[str, Any]]], registry: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._sources = sources  # the adapter registry: name -> Adapter (its `source` is the lora_path)
        self._held: dict[str, tuple[str, str]] = {}  # request id -> (engine, adapter) it holds
        self._auth = auth_headers
        self.metrics = PlacementMetrics(registry) if registry is not None else None
        self.clock = clock
        self.slots: dict[str, Slots] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._read_at: dict[str, float] = {}
        self._deleted: set[str] = set()  # adapters to unload everywhere once their requests finish
        self._http: httpx.AsyncClient | None = None
        # wiring sets these: the engine's scraped metrics (telemetry), and the holds shared with other
        # replicas (gateway/adapters/holds.py; None in a lone process)
        self.engine_load: Callable[[str], EngineLoad | None] | None = None
        self.shared: Callable[[], SharedHolds | None] | None = None
        self.holds: SharedHolds | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self._engine_max: dict[str, int] = {}  # engine -> the max_lora it exports (vllm:lora_requests_info)

    # ---- lifecycle (a gateway service)
    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: the dynamic backends are read from `config()` per request."""

    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=LOAD_TIMEOUT_S)
        self.holds = self.shared() if self.shared is not None else None
        if self.holds is not None:
            await self.holds.start()

    async def close(self) -> None:
        for t in list(self._bg):
            await asyncio.gather(t, return_exceptions=True)
        if self.holds is not None:
            await self.holds.close()
            self.holds = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=LOAD_TIMEOUT_S)
        return self._http

    def _engine(self, name: str) -> EngineLoad | None:
        """The engine's last scrape, when fresh enough to act on."""
        ld = self.engine_load(name) if self.engine_load is not None else None
        return ld if ld is not None and ld.healthy and time.time() - ld.scraped_at <= ENGINE_FRESH_S else None

    def _slots(self, b: BackendConfig) -> Slots:
        s = self.slots.get(b.name)
        n = b.lora.max_loras if b.lora is not None else 1
        if n is None:  # the engine's own --max-loras, as it exports it (read with its adapters); else vLLM's 1
            ld = self._engine(b.name)
            n = self._engine_max.get(b.name) or (ld.max_lora if ld is not None else None) or 1
        if s is None:
            s = self.slots[b.name] = Slots(max_loras=n)
        s.max_loras = n
        return s

    def _lock(self, name: str) -> asyncio.Lock:
        lk = self._locks.get(name)
        if lk is None:
            lk = self._locks[name] = asyncio.Lock()
        return lk

    def placed(self, ctx: RequestContext, cand: Candidate) -> str | None:
        """The registered adapter this candidate must hold, when it is a dynamic engine serving it at run time
        (not one the config serves it on statically)."""
        ad = ctx.adapter
        if ad is None or ad.name != cand.model or not is_dynamic(cand.backend):
            return None
        return None if cand.backend.name in self._config().models.get(cand.model, ()) else cand.model

    # ---- the stage's half: nothing before routing; finish releases the request's hold
    async def run(self, ctx: RequestContext) -> None:
        return None

    async def finish(self, ctx: RequestContext) -> None:
        held = self._held.pop(ctx.request_id, None)
        if held is not None:
            await self._release(*held)

    async def _release(self, engine: str, adapter: str) -> None:
        s = self.slots.get(engine)
        if s is None:
            return
        n = s.inflight.get(adapter, 0) - 1
        s.released[adapter] = time.time()
        await self._share(engine, adapter, max(0, n), wait=False)
        if n > 0:
            s.inflight[adapter] = n
            return
        s.inflight.pop(adapter, None)
        if adapter in self._deleted or adapter not in await self._sources():  # deleted (here or on a replica)
            b = self._backend(engine)
            if b is not None:
                try:
                    async with self._lock(engine):
                        if not s.busy(adapter) and adapter in s.resident:
                            await self._unload(b, s, adapter)
                except GatewayError as e:
                    log.warning("adapter %s: unload on %s failed: %s", adapter, engine, e.message)

    def _backend(self, name: str) -> BackendConfig | None:
        try:
            return self._config().backend(name)
        except Exception:
            return None

    # ---- the dispatcher's half
    def _prior(self) -> float:
        return mean_load(self.slots.values())

    def setup_s(self, ctx: RequestContext, cands: list[Candidate]) -> dict[str, float]:
        """Per candidate engine, the load this request's adapter needs there first (0 where it is resident,
        left out where the candidate is not a placement): the routing stage adds it to the predicted TTFT, so
        admission and the evidence count it. From the belief only (no I/O); nothing for a request that is not
        for a registered adapter (every other request passes here on its way through routing)."""
        out: dict[str, float] = {}
        if ctx.adapter is None:
            return out
        prior = self._prior()
        for c in cands:
            adapter = self.placed(ctx, c)
            if adapter is None or not load_aware(c.backend):
                continue
            s = self._slots(c.backend)
            st = step(adapter, s)
            if st is not None and st.load:
                out[c.backend.name] = load_cost_s(s, prior)
        return out

    def order(self, ctx: RequestContext, cands: list[Candidate]) -> list[Candidate]:
        """An adapter request's dynamic candidates in `choose` order (full engines dropped), after the others.
        The predicted TTFT `choose` weighs is the engine's own (without the load the routing stage added)."""
        dyn = [c for c in cands if self.placed(ctx, c)]
        if not dyn:
            return cands
        adapter = dyn[0].model
        by_name = {c.backend.name: c for c in dyn}
        for c in dyn:
            self._slots(c.backend)
        engines = []
        for c in dyn:
            t = c.predicted_ttft_ms
            engines.append((c.backend.name, None if t is None else (t - c.info.get("adapter_load_ms", 0.0)) / 1000))
        picks = choose(adapter, engines, self.slots, self._prior(), load_aware=all(load_aware(c.backend) for c in dyn))
        rest = [c for c in cands if c not in dyn]
        if not picks and not rest:  # every engine's slots hold adapters with requests in flight
            raise GatewayError(503, f"Every adapter slot of the engines serving '{adapter}' has requests in "
                               "flight; retry shortly.", code="adapter_slots_busy", headers=retry_headers(1.0))
        ad = ctx.evidence.get("adapter")
        if isinstance(ad, dict):
            ad["choice"] = [n for n, _ in picks]
        return rest + [by_name[n] for n, _ in picks]

    def snapshot(self) -> list[dict[str, Any]]:
        """Where adapters are, as this process believes (the admin route and the dashboard show it)."""
        now = self.clock()
        prior = self._prior()
        out = []
        for name, s in sorted(self.slots.items()):
            read = self._read_at.get(name)
            out.append({"backend": name, "max_loras": s.max_loras,
                        "load_s": round(load_cost_s(s, prior), 4), "load_learned": s.load_s is not None,
                        "read_age_s": None if read is None else round(now - read, 3),
                        "adapters": [{"name": a, "inflight": s.inflight.get(a, 0), "idle_s": round(now - t, 3)}
                                     for a, t in sorted(s.resident.items(), key=lambda kv: -kv[1])]})
        return out

    async def prepare(self, ctx: RequestContext, cand: Candidate) -> None:
        """Make the adapter resident on the candidate's engine (loading it, unloading the LRU idle one when the
        engine is full) and hold it there until the request finishes. 503 (retryable) when it cannot."""
        adapter = self.placed(ctx, cand)
        if adapter is None:
            return
        prev = self._held.pop(ctx.request_id, None)
        if prev is not None:  # an earlier attempt of this request (another engine, or a retry) held one
            await self._release(*prev)
        ad = ctx.evidence["adapter"]
        reg = await self._sources()
        a = reg.get(adapter)
        if a is None:  # deleted since the adapters stage ran: refused like a deleted model
            raise GatewayError(404, f"The model '{adapter}' does not exist or you do not have access to it.",
                               code="model_not_found", param="model")
        b = cand.backend
        s = self._slots(b)
        t0 = time.perf_counter()
        try:
            loaded = await self._hold(b, s, adapter, a.source)
        finally:  # the wait and the load are part of this request's TTFT, not the engine's work
            ctx.setup_s += time.perf_counter() - t0
        self._held[ctx.request_id] = (b.name, adapter)
        await self._share(b.name, adapter, s.inflight.get(adapter, 0), wait=True)
        ad["engine"] = b.name
        ad["loaded"] = loaded

    async def _hold(self, b: BackendConfig, s: Slots, adapter: str, source: str) -> bool:
        """Hold `adapter` on the engine (its count of requests in flight up), loading it first where it is not
        resident; True when this call started the load. The engine's lock covers the decision and an unload,
        never a load: a request for a resident adapter takes no lock (unless the engine is due a re-read), one
        for an adapter being loaded waits for that load, and a load runs as its own task, so a client leaving
        does not leave the engine half-placed. 503 (retryable) when every slot has requests in flight."""
        while True:
            due = b.lora is None or self.clock() - self._read_at.get(b.name, -1e9) > b.lora.refresh_s
            if not due:
                task = s.loading.get(adapter)
                if task is not None:
                    await asyncio.shield(task)  # its error (a failed load) is this request's too
                    continue
                if adapter in s.resident:
                    s.resident[adapter] = self.clock()
                    s.inflight[adapter] = s.inflight.get(adapter, 0) + 1
                    return False
            async with self._lock(b.name):
                if b.lora is None or self.clock() - self._read_at.get(b.name, -1e9) > b.lora.refresh_s:
                    await self._read(b, s)
                if adapter in s.loading:
                    continue  # loading already: wait for it outside the lock
                st = step(adapter, s)
                if st is None or st.evict is not None:  # an unload: not of what the engine or a replica is using
                    await self._others(b, s)
                    st = step(adapter, s)
                    s.others = frozenset()
                if st is None:
                    raise GatewayError(503, f"Every adapter slot of backend {b.name} is in use.",
                                       code="adapter_slots_busy", headers=retry_headers(1.0),
                                       extra={"_retryable": True})
                if st.evict is not None:
                    await self._unload(b, s, st.evict)
                if not st.load:
                    s.resident[adapter] = self.clock()
                    s.inflight[adapter] = s.inflight.get(adapter, 0) + 1
                    return False
                s.resident[adapter] = self.clock()  # the slot is taken from now (never an LRU victim: loading)
                s.inflight[adapter] = s.inflight.get(adapter, 0) + 1  # and this request holds it from now
                task = asyncio.ensure_future(self._load_task(b, s, adapter, source))
                task.add_done_callback(_retrieved)
                s.loading[adapter] = task
            try:
                await asyncio.shield(task)
            except BaseException:  # the load failed, or this request was cancelled: its hold ends
                n = s.inflight.get(adapter, 0) - 1
                if n > 0:
                    s.inflight[adapter] = n
                else:
                    s.inflight.pop(adapter, None)
                raise
            s.resident[adapter] = self.clock()
            return True

    async def _load_task(self, b: BackendConfig, s: Slots, adapter: str, source: str) -> None:
        try:
            await self._load(b, s, adapter, source)
        except BaseException:
            s.resident.pop(adapter, None)
            raise
        finally:
            s.loading.pop(adapter, None)

    async def not_loaded(self, ctx: RequestContext, cand: Candidate) -> None:
        """The engine answered 404 for the adapter: it lost it (a restart, an unload behind our back). Drop the
        request's hold and re-read the engine's adapters, so `prepare` loads it again."""
        held = self._held.pop(ctx.request_id, None)
        if held is not None:
            await self._release(*held)
        ad = ctx.evidence.get("adapter")
        if isinstance(ad, dict):
            ad["reloaded"] = True  # the audit record says the engine had lost it
        s = self._slots(cand.backend)
        async with self._lock(cand.backend.name):
            s.resident.pop(cand.model, None)
            await self._read(cand.backend, s)

    @staticmethod
    def not_loaded_answer(result: Any, adapter: str) -> bool:
        return not_loaded_answer(result.status, result.upstream_message, adapter)

    # ---- shared with other processes
    async def _share(self, engine: str, adapter: str, n: int, wait: bool) -> None:
        """Publish this process's hold count when it crossed zero: awaited for a first hold (before the request
        is sent), in the background for a last release."""
        h = self.holds
        if h is None or not h.note(engine, adapter, n):
            return
        if wait:
            try:
                await h.flush(engine, adapter)
            except Exception as e:  # the store away: the engine's own report still guards its requests
                log.warning("adapter holds: publishing %s on %s failed: %s", adapter, engine, e)
            return
        t = asyncio.create_task(self._flush_later(h, engine, adapter))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    @staticmethod
    async def _flush_later(h: SharedHolds, engine: str, adapter: str) -> None:
        try:
            await h.flush(engine, adapter)
        except Exception as e:
            log.warning("adapter holds: publishing %s on %s failed: %s", adapter, engine, e)

    async def _others(self, b: BackendConfig, s: Slots) -> None:
        """What others are using on the engine, before an unload: adapters with requests running or waiting as
        the engine reports them (fresh vllm:lora_requests_info) and those another process holds (shared holds,
        whose latest use also counts for the LRU choice). The engine's report is read now (else the
        telemetry's last scrape), and not counted for an adapter whose last request of ours ended after it was
        taken (it may have been ours). Unreadable holds: every resident adapter counts as
        used (nothing is unloaded that another process may be using)."""
        busy: set[str] = set()
        ld = await self._scrape(b)
        if ld is not None:  # not what may have been our own request, ended since the engine was scraped
            busy.update(a for a in (*ld.lora_running, *ld.lora_waiting)
                        if s.released.get(a, 0.0) < ld.scraped_at)
        if self.holds is not None:
            try:
                others = await self.holds.others(b.name)
            except Exception as e:
                log.warning("adapter holds: reading %s failed: %s", b.name, e)
                busy.update(s.resident)
            else:
                mono, wall = self.clock(), time.time()
                for a, h in others.items():
                    if h.inflight > 0:
                        busy.add(a)
                    if a in s.resident:
                        s.resident[a] = max(s.resident[a], mono - max(0.0, wall - h.used_at))
        s.others = frozenset(busy)

    # ---- DELETE
    async def forget(self, adapter: str) -> None:
        """The adapter was deleted: unload it wherever no request holds it now; elsewhere when the last ends."""
        self._deleted.add(adapter)
        if self.holds is not None:
            try:
                await self.holds.forget_adapter(adapter)
            except Exception as e:
                log.warning("adapter holds: forgetting %s failed: %s", adapter, e)
        for b in self._config().backends:  # every dynamic engine, read afresh: a replica may have placed it
            if not is_dynamic(b):
                continue
            s = self._slots(b)
            try:
                async with self._lock(b.name):
                    await self._read(b, s)
                    if adapter not in s.resident:
                        continue
                    await self._others(b, s)
                    if not s.busy(adapter):
                        await self._unload(b, s, adapter)
                    s.others = frozenset()
            except GatewayError as e:  # the engine is away: a restart loses it anyway; the next read forgets it
                log.warning("adapter %s: unload on %s failed: %s", adapter, b.name, e.message)

    def registered(self, adapter: str) -> None:
        """A (re-)registered adapter is no longer pending deletion."""
        self._deleted.discard(adapter)

    # ---- engine I/O
    async def _scrape(self, b: BackendConfig) -> EngineLoad | None:
        """The engine's adapter report read now (an unload is rare; its decision wants the freshest), else the
        telemetry's last scrape when fresh; None when neither is to be had."""
        url = b.metrics or (b.server_root.rstrip("/") + "/metrics")
        try:
            r = await self._client().get(url, headers=self._auth(b), timeout=2.0)
            if r.status_code == 200:
                ld = parse_metrics(r.text)
                if ld.max_lora:
                    self._engine_max[b.name] = ld.max_lora
                return ld
        except (httpx.HTTPError, ValueError):
            pass
        return self._engine(b.name)

    async def _read(self, b: BackendConfig, s: Slots) -> None:
        """The engine's resident adapters from its /v1/models (what it lost is forgotten; what it gained is kept
        with the oldest use time)."""
        try:
            r = await self._client().get(b.server_root + "/v1/models", headers=self._auth(b), timeout=5.0)
            ids = adapter_ids(r.json(), [b.upstream_model(m) for m in b.models]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            ids = None
        if ids is None:
            return  # unreadable now: keep the belief, read again next time
        s.resident = {n: s.resident.get(n, 0.0) for n in ids | set(s.loading)}  # a load under way keeps its slot
        self._read_at[b.name] = self.clock()
        if b.lora is not None and b.lora.max_loras is None:  # its slots as the engine says
            await self._scrape(b)
            s.max_loras = self._slots(b).max_loras

    async def _post(self, b: BackendConfig, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._client().post(b.server_root + path, json=body, headers=self._auth(b))
        except httpx.HTTPError:
            raise GatewayError(503, f"Backend {b.name} could not be reached to place the adapter.",
                               code="upstream_unavailable", headers=retry_headers(1.0),
                               extra={"_retryable": True}) from None

    async def _load(self, b: BackendConfig, s: Slots, adapter: str, source: str) -> None:
        t0 = time.perf_counter()
        r = await self._post(b, "/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": source})
        took = time.perf_counter() - t0
        if r.status_code == 400 and "already been loaded" in r.text:
            return  # resident after all (loaded behind our back)
        if r.status_code != 200:
            raise GatewayError(502, f"Backend {b.name} failed to load the adapter (HTTP {r.status_code}).",
                               code="adapter_load_failed", extra={"_retryable": True})
        s.load_s = learn_load(s.load_s, took)
        if self.metrics is not None:
            self.metrics.ops.labels(b.name, "load").inc()

    async def _unload(self, b: BackendConfig, s: Slots, adapter: str) -> None:
        r = await self._post(b, "/v1/unload_lora_adapter", {"lora_name": adapter})
        if r.status_code not in (200, 404):  # 404: already gone
            raise GatewayError(502, f"Backend {b.name} failed to unload an adapter (HTTP {r.status_code}).",
                               code="adapter_unload_failed", extra={"_retryable": True})
        s.resident.pop(adapter, None)
        if self.metrics is not None and r.status_code == 200:
            self.metrics.ops.labels(b.name, "unload").inc()


def adapter_backends(config: Config, ctx: RequestContext, model: str) -> list[BackendConfig]:
    """The backends that may serve `model` for this request: the config's, else, for the registered adapter the
    adapters stage let through, the dynamic engines of its base model (as candidates serving it)."""
    names = config.models.get(model)
    if names:
        return [config.backend(n) for n in names]
    ad = ctx.adapter
    if ad is None or ad.name != model:
        return []
    return [as_adapter_backend(b, model) for b in dynamic_backends(config, ad.base_model)]
