"""TelemetryService: the telemetry plane behind one object the request path calls.

Owns the KV index, one KVEventSubscriber per engine with kv_events, one metrics scrape loop per engine, the
token source, the gateway's own in-flight accounting, and the agreement between predicted and actual cached
tokens (in /admin/fleet, and at /metrics as the gateway_kv_index_*agreement_ratio gauges and the
gateway_kv_*_cached_tokens_total / gateway_kv_agreement_requests_total counters, which
gateway.observability.collect reads from fleet_snapshot()'s per-engine Agreement at scrape time).

Silence is an alarm: the service tells each subscriber's StreamWatch when its engine did work that must
produce KV events (a request served there with >= one block of uncached prompt, via the gateway's finish
hook `observe_served`; the engine's scraped uncached prefix-cache tokens growing by >= one block), and
re-judges every stream each second, so an engine whose events never arrive is reported stale with a reason
(gateway/telemetry/stream_health.py) in /admin/fleet, /metrics, the dashboard and the route evidence.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import httpx

from gateway.config import BackendConfig, Config
from gateway.telemetry.index import CachedPrefix, KVIndex, RequestKeys
from gateway.telemetry.scraper import EngineLoad, scrape
from gateway.telemetry.subscriber import KVEventSubscriber
from gateway.telemetry.tokens import TokenSource

BLOCK_COUNTS_MAX_AGE_S = 2.0  # fleet_snapshot uses an off-loop count this fresh, else counts inline
# Block size assumed for "did the engine fill a block?" while neither events nor /metrics told it: larger than
# vLLM's defaults (16 on GPU, 128 on CPU), so an unknown engine needs more evidence, never less.
UNKNOWN_BLOCK_SIZE = 1024


@dataclass
class Agreement:
    """Predicted vs actual cached tokens for one engine (tokens and requests), all-time and over a window."""

    requests: int = 0
    requests_exact: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    agreed_tokens: int = 0  # sum of min(predicted, actual)
    abs_error_tokens: int = 0  # sum of |predicted - actual|
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=200))

    @staticmethod
    def ratio(agreed: int, pred: int, actual: int) -> float:
        """Token agreement: agreed / max(pred total, actual total) (1.0 when both are 0)."""
        den = max(pred, actual)
        return 1.0 if den == 0 else agreed / den

    def token_agreement(self) -> float:
        return self.ratio(self.agreed_tokens, self.predicted_tokens, self.actual_tokens)

    def error_agreement(self) -> float:
        """1 - sum |predicted - actual| / sum actual: how a client measures the index against the engines'
        `usage.prompt_tokens_details.cached_tokens` (an over- and an under-prediction both count against it;
        1.0 when nothing was cached and nothing predicted)."""
        if self.actual_tokens == 0:
            return 1.0 if self.abs_error_tokens == 0 else 0.0
        return 1.0 - self.abs_error_tokens / self.actual_tokens

    def window_agreement(self) -> float:
        p = sum(x for x, _ in self.window)
        a = sum(y for _, y in self.window)
        return self.ratio(sum(min(x, y) for x, y in self.window), p, a)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "requests_exact": self.requests_exact,
                "request_agreement": round(self.requests_exact / self.requests, 4) if self.requests else None,
                "predicted_tokens": self.predicted_tokens, "actual_tokens": self.actual_tokens,
                "agreed_tokens": self.agreed_tokens, "token_agreement": round(self.token_agreement(), 4),
                "abs_error_tokens": self.abs_error_tokens, "error_agreement": round(self.error_agreement(), 4),
                "window_token_agreement": round(self.window_agreement(), 4)}


@dataclass
class InFlight:
    requests: int = 0
    prefill_tokens: int = 0


def _telemetry_backends(config: Config) -> list[BackendConfig]:
    from gateway.proxy.dialects import publishes_kv_events

    return [b for b in config.backends if publishes_kv_events(b)]


class TelemetryService:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.index = KVIndex()
        tc = config.raw.telemetry
        self._client = httpx.AsyncClient()
        self.tokens = TokenSource(tc.tokenizer, tc.token_cache_size, tc.tokenize_timeout_s)
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._scrapers: dict[str, asyncio.Task[None]] = {}
        self._loads: dict[str, EngineLoad] = {}
        self._inflight: dict[str, InFlight] = {}
        self._agree: dict[str, Agreement] = {}
        self._backends: dict[str, BackendConfig] = {}
        self._started = False
        self._block_counts: tuple[float, dict[str, dict[str, int]]] | None = None  # (monotonic, counts)
        self._uncached_base: dict[str, tuple[float, int]] = {}  # engine -> (scraped uncached tokens, batches)
        self._watch_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._started = True
        for b in _telemetry_backends(self.config):
            await self._start_backend(b)
        self._watch_task = asyncio.create_task(self._watch_loop(), name="kv-stream-watch")

    async def _start_backend(self, b: BackendConfig) -> None:
        tc = self.config.raw.telemetry
        self._backends[b.name] = b
        if b.kv_cache_report_mode == "full":
            self.index.set_report_full(b.name, True)
        if tc.kv_events and b.kv_events:
            sub = KVEventSubscriber(b.name, b.kv_events, b.replay, self.topic_for(b), self.index,
                                    max_pending=tc.max_pending_batches, replay_timeout_s=tc.replay_timeout_s,
                                    silence_grace_s=tc.kv_silence_grace_s)
            await sub.start()
            self.subscribers[b.name] = sub
        url = b.metrics or (b.server_root.rstrip("/") + "/metrics")
        self._scrapers[b.name] = asyncio.create_task(self._scrape_loop(b.name, url, self.form(b.name)),
                                                     name=f"scrape-{b.name}")

    async def _stop_backend(self, name: str, forget: bool = True) -> None:
        sub = self.subscribers.pop(name, None)
        if sub is not None:
            await sub.close()
        t = self._scrapers.pop(name, None)
        if t is not None:
            t.cancel()
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._backends.pop(name, None)
        self._uncached_base.pop(name, None)
        if forget:
            self.index.remove_engine(name)
            self._loads.pop(name, None)

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except (asyncio.CancelledError, Exception):
                pass
            self._watch_task = None
        for name in list(self._backends):
            await self._stop_backend(name, forget=False)
        await self._client.aclose()
        await self.tokens.close()

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing beyond load_config's checks."""

    async def swap_config(self, config: Config) -> None:
        """Hot reload: start new engines, stop removed ones, restart those whose endpoints or kind (its formats)
        changed."""
        old = self._backends
        self.config = config
        new = {b.name: b for b in _telemetry_backends(config)}
        for name in list(old):
            if name not in new:
                await self._stop_backend(name)
            elif (old[name].kv_events, old[name].replay, old[name].metrics, old[name].url, old[name].kind) != \
                    (new[name].kv_events, new[name].replay, new[name].metrics, new[name].url, new[name].kind):
                await self._stop_backend(name)
            elif name in self.subscribers:  # same stream: a new topic or grace applies in place
                self.subscribers[name].retune(self.topic_for(new[name]), config.raw.telemetry.kv_silence_grace_s)
        if self._started:
            for name, b in new.items():
                if name not in self._backends:
                    await self._start_backend(b)

    def form(self, engine: str | None) -> str:
        """The formats (metrics, /tokenize) of an engine's kind: "vllm" or "sglang" (the dialect registry)."""
        from gateway.proxy.dialects import telemetry_form

        b = self._backends.get(engine) if engine else None
        return (telemetry_form(b.kind) if b is not None else None) or "vllm"

    async def _scrape_loop(self, name: str, url: str, form: str = "vllm") -> None:
        tc = self.config.raw.telemetry
        while True:
            load = await scrape(self._client, url, tc.scrape_timeout_s, form)
            self._loads[name] = load
            if load.block_size and self.index.block_size(name) is None:
                self.index.set_block_size(name, load.block_size)
            self._observe_load(name, load)
            await asyncio.sleep(tc.scrape_interval_s)

    # ------------------------------------------------------------------------------ stream silence
    def topic_for(self, b: BackendConfig) -> str:
        """The backend's own kv_topic, else telemetry.kv_topic; "" (vLLM's default) takes every topic."""
        return b.kv_topic if b.kv_topic is not None else self.config.raw.telemetry.kv_topic

    def _silence_block_size(self, engine: str, load: EngineLoad | None = None) -> int:
        load = load or self._loads.get(engine)
        return self.index.block_size(engine) or (load.block_size if load else None) or UNKNOWN_BLOCK_SIZE

    def observe_served(self, engine: str | None, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """A request the gateway served on `engine` finished: with >= one block of prompt the engine did not
        have cached, the engine stored a new block and must publish a BlockStored. Without cached_tokens
        (engine lacks --enable-prompt-tokens-details) a repeat may have been fully cached: not evidence."""
        sub = self.subscribers.get(engine) if engine else None
        if sub is None or prompt_tokens is None or cached_tokens is None:
            return
        if prompt_tokens - cached_tokens >= self._silence_block_size(engine):  # type: ignore[arg-type]
            sub.watch.on_activity(time.monotonic(), "served_request")

    def _observe_load(self, engine: str, load: EngineLoad) -> None:
        """The engine's scraped counters show it computed >= one block of uncached prompt since the last batch
        (requests that bypass the gateway included)."""
        sub = self.subscribers.get(engine)
        if sub is None or not load.healthy:
            return
        if load.prefix_queries:
            uncached = load.prefix_queries - load.prefix_hits
        else:
            uncached = load.prompt_tokens - load.prompt_tokens_cached
        base = self._uncached_base.get(engine)
        if base is None or base[1] != sub.watch.batches or uncached < base[0]:
            # first scrape, a batch arrived since (what was counted so far is explained), or counters reset
            self._uncached_base[engine] = (uncached, sub.watch.batches)
        elif uncached - base[0] >= self._silence_block_size(engine, load):
            sub.watch.on_activity(time.monotonic(), "engine_metrics")

    def evaluate_streams(self, now: float | None = None) -> None:
        for sub in list(self.subscribers.values()):
            sub.evaluate_stream(now)

    async def _watch_loop(self) -> None:
        while True:
            grace = self.config.raw.telemetry.kv_silence_grace_s
            await asyncio.sleep(max(0.05, min(1.0, grace / 4)))
            try:
                self.evaluate_streams()
            except Exception:  # never let the watch die
                pass

    def kv_view(self, engine: str) -> dict[str, Any] | None:
        """The engine's KV-view state for evidence and routing: stale, reason (no_events | wrong_topic | decode
        | gap), detail, batches, last batch age. None for engines without a KV-event stream."""
        sub = self.subscribers.get(engine)
        if sub is None:
            return None
        now = time.monotonic()
        sub.evaluate_stream(now)
        w = sub.watch
        reason = w.reason or ("gap" if sub.stale else None)
        return {"stale": reason is not None, "reason": reason,
                "detail": w.detail(now) if w.reason else sub.stale_reason,
                "batches": w.batches,
                "last_batch_age_s": round(now - w.last_batch_at, 3) if w.last_batch_at is not None else None,
                "other_topic_frames": w.other_topic_frames}

    # ------------------------------------------------------------------------------ request path
    async def tokens_for(self, backend_name: str | None, endpoint: str | None, body: dict[str, Any],
                         retain: bool = True) -> tuple[list[int], str]:
        """Token ids of a request and their source ("local" | "engine" | "approx"). retain=False (a
        zero-retention request) keeps them out of the token cache: tokenized, used, dropped."""
        if endpoint is None and backend_name in self._backends:
            endpoint = self._backends[backend_name].server_root
        return await self.tokens.tokens(endpoint, body, retain=retain, form=self.form(backend_name))

    def lookup(self, engine_names: Iterable[str], tokens: Sequence[int] | RequestKeys, salt: str | None = None,
               lora: str | None = None) -> dict[str, CachedPrefix]:
        """Per engine: longest cached prefix (tokens, by tier). Stale engines are still answered (see fleet)."""
        return self.index.lookup(engine_names, tokens, salt, lora)

    def is_stale(self, engine: str) -> bool:
        """Rebuilding after lost events, or the stream is silent / on another topic / undecodable."""
        s = self.subscribers.get(engine)
        return bool(s and (s.stale or s.stream_stale))

    def load(self, engine: str) -> EngineLoad | None:
        return self._loads.get(engine)

    def inflight(self, engine: str) -> InFlight:
        return self._inflight.setdefault(engine, InFlight())

    def begin(self, engine: str, prefill_tokens: int) -> None:
        f = self.inflight(engine)
        f.requests += 1
        f.prefill_tokens += prefill_tokens

    def end(self, engine: str, prefill_tokens: int = 0) -> None:
        f = self.inflight(engine)
        f.requests = max(0, f.requests - 1)
        f.prefill_tokens = max(0, f.prefill_tokens - prefill_tokens)

    def observe_cached(self, engine: str, predicted: int, actual: int,
                       request_keys: RequestKeys | None = None) -> None:
        """Record predicted vs actual cached tokens for a finished request on `engine`.

        While the engine's view is stale (rebuilding after an unrecoverable gap), an over-prediction also
        removes the blocks the engine proved it does not hold; agreement back above the threshold over the
        window clears the stale mark.
        """
        predicted, actual = int(predicted), int(actual)
        a = self._agree.setdefault(engine, Agreement(window=deque(maxlen=self.config.raw.telemetry.agreement_window)))
        a.requests += 1
        a.requests_exact += predicted == actual
        a.predicted_tokens += predicted
        a.actual_tokens += actual
        a.agreed_tokens += min(predicted, actual)
        a.abs_error_tokens += abs(predicted - actual)
        a.window.append((predicted, actual))
        sub = self.subscribers.get(engine)
        if sub is not None and sub.stale:
            bs = self.index.block_size(engine)
            if predicted > actual and request_keys is not None and bs:
                self.index.forget_from(engine, request_keys.keys(bs)[actual // bs: predicted // bs])
            tc = self.config.raw.telemetry
            if len(a.window) >= min(20, a.window.maxlen or 20) and a.window_agreement() >= tc.agreement_recovered:
                sub.mark_fresh()

    def agreement(self, engine: str | None = None) -> dict[str, Any]:
        if engine is not None:
            return self._agree.get(engine, Agreement()).to_dict()
        tot = Agreement()
        for a in self._agree.values():
            tot.requests += a.requests
            tot.requests_exact += a.requests_exact
            tot.predicted_tokens += a.predicted_tokens
            tot.actual_tokens += a.actual_tokens
            tot.agreed_tokens += a.agreed_tokens
            tot.abs_error_tokens += a.abs_error_tokens
        d = tot.to_dict()
        d.pop("window_token_agreement")
        return d

    async def refresh_block_counts(self) -> None:
        """Count the index's blocks per engine and tier in a worker thread (the HTTP handlers that show them
        call this first), so fleet_snapshot() does not scan the table on the event loop."""
        counts = await asyncio.to_thread(KVIndex.count_blocks, self.index.block_count_snapshot())
        self._block_counts = (time.monotonic(), counts)

    def _blocks(self, name: str) -> dict[str, int]:
        bc = self._block_counts
        if bc is not None and time.monotonic() - bc[0] < BLOCK_COUNTS_MAX_AGE_S:
            return bc[1].get(name, {})
        return self.index.engine_blocks(name)  # no recent off-loop count: count here

    def fleet_snapshot(self) -> dict[str, Any]:
        """For /admin/fleet: per engine cached blocks by tier, load, staleness, agreement."""
        engines: dict[str, Any] = {}
        st_eng = self.index.stats()["engines"]
        for name in self._backends:
            sub = self.subscribers.get(name)
            load = self._loads.get(name)
            f = self._inflight.get(name, InFlight())
            view = self.kv_view(name)
            engines[name] = {
                "block_size": self.index.block_size(name),
                "cached_blocks": self._blocks(name),
                "kv_events": sub.snapshot() if sub else None,
                "stale": bool(view and view["stale"]),
                "stale_reason": view["reason"] if view else None,
                "stale_detail": view["detail"] if view else None,
                "load": load.to_dict() if load else None,
                "inflight": {"requests": f.requests, "prefill_tokens": f.prefill_tokens},
                "agreement": self.agreement(name),
                "kv_event_fields": st_eng.get(name, {}).get("event_fields", []),
                "kv_groups": st_eng.get(name, {}).get("kv_groups", {}),
            }
        st = self.index.stats()
        return {"generated_at": time.time(), "engines": engines, "agreement": self.agreement(),
                "index": {k: v for k, v in st.items() if k != "engines"},
                "tokens": {"mode": self.tokens.mode, "by_source": dict(self.tokens.by_source),
                           "cache_hits": self.tokens.hits, "cache_misses": self.tokens.misses,
                           "uncached": self.tokens.uncached,
                           "local_error": self.tokens.local_error}}
