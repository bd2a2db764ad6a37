"""The asyncio driver around the scheduler: one task per engine that sleeps each step's modelled time.

Requests are submitted from HTTP handlers and get two futures: `first` (resolved at the end of the step that
produced the first token, so a stream can send it at exactly that moment) and `done`. Between those, streams
read the request's token count at their own coarse pace; no per-token asyncio work happens.
Faults that act on the engine itself (slow steps, hangs, event delay/loss, restart) live here too.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq

from backends.sim.kv_wire import Wire, WireForm
from backends.sim.profiles import EngineProfile
from backends.sim.publisher import KVEventPublisher
from backends.sim.scheduler import ABORTED, FINISHED, Scheduler, SimRequest
from backends.sim.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDead(Exception):
    """The engine crashed or restarted while the request was in flight."""


@dataclass
class Faults:
    """Faults on demand; all off by default. Set through CLI flags or POST /sim/faults."""

    event_delay_ms: float = 0.0
    event_loss: float = 0.0  # probability a batch never reaches PUB (still replayable)
    slow_factor: float = 1.0  # multiplies every step's time
    error_rate: float = 0.0  # probability a generation request is answered HTTP 500
    hang: bool = False  # requests (and /health) wait until the hang is cleared; the engine stops stepping

    def as_dict(self) -> dict[str, object]:
        return {"event_delay_ms": self.event_delay_ms, "event_loss": self.event_loss,
                "slow_factor": self.slow_factor, "error_rate": self.error_rate, "hang": self.hang}


@dataclass(eq=False)
class Waiters:
    first: asyncio.Future[None]
    done: asyncio.Future[None]
    loop_time_submitted: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)


class SimEngine:
    """One simulated vLLM engine core: scheduler + KV-event publisher + step loop."""

    def __init__(self, profile: EngineProfile, *, name: str = "sim-0", model: str = "sim-model",
                 engine_index: int = 0, host: str = "127.0.0.1", zmq_port: int = 0, replay_port: int = 0,
                 topic: str = "", enable_prefix_caching: bool = True, priority_policy: bool = False,
                 batch_form: WireForm = "array", event_form: WireForm = "map", faults: Faults | None = None,
                 tokenizer: Tokenizer | None = None, present_as: Wire = "vllm") -> None:
        self.profile = profile
        self.name = name
        self.model = model
        self.engine_index = engine_index
        self.host = host
        self.topic = topic
        self.enable_prefix_caching = enable_prefix_caching
        self.priority_policy = priority_policy
        self.present_as = present_as  # "sglang": SGLang's KV-event payloads, metrics, errors, priority order
        self._forms = (batch_form, event_form)
        self._zmq_ports = (zmq_port, replay_port)
        self.faults = faults or Faults()
        self.tokenizer = tokenizer or Tokenizer()
        self._out_ids = self.tokenizer.output_ids
        self.publisher: KVEventPublisher | None = None
        self.sched = self._new_scheduler()
        self._lora_ids: dict[str, int] = {}
        self.max_loras: int | None = None  # --enable-lora --max-loras N: distinct adapters one batch runs
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._unhang = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.generation = 0  # bumps on every restart
        self.costs: OrderedDict[str, float] = OrderedDict()  # sim only: request id -> its true engine seconds
        self.started_at = time.time()

    # ------------------------------------------------------------------ lifecycle
    def _new_scheduler(self) -> Scheduler:
        s = Scheduler(self.profile, self._output_token, self.enable_prefix_caching, self.priority_policy)
        s.slow_factor = self.faults.slow_factor
        s.max_loras = getattr(self, "max_loras", None)
        s.lora_cache_size, s.lora_load_s = getattr(self, "_lora_cache", (None, 0.0))
        return s

    def set_max_loras(self, n: int | None, cache_size: int | None = None, load_s: float = 0.0) -> None:
        """--enable-lora: `n` distinct adapters per batch; `cache_size` adapters' weights held in memory
        (--max-cpu-loras), an adapter outside it read in `load_s` by the step that first runs it."""
        self.max_loras = n
        self.sched.max_loras = n
        self._lora_cache = (cache_size, load_s)
        self.sched.lora_cache_size, self.sched.lora_load_s = cache_size, load_s

    def _output_token(self, req: SimRequest) -> int:
        ids = self._out_ids
        return ids[(((req.seed + req.num_output) * 2654435761) >> 9) % len(ids)]

    async def start(self) -> None:
        for attempt in range(100):  # zmq closes listeners asynchronously: a rebind after restart may need a moment
            try:
                self.publisher = KVEventPublisher(self.host, self._zmq_ports[0], self._zmq_ports[1], self.topic,
                                                  batch_form=self._forms[0], event_form=self._forms[1],
                                                  wire=self.present_as)
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or attempt == 99:
                    raise
                await asyncio.sleep(0.02)
        pub = self.publisher
        assert pub is not None  # the loop above bound one or raised
        self._zmq_ports = (pub.port, pub.replay_port)  # keep them across restarts
        pub.start()
        self.apply_faults()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-{self.name}")

    async def stop(self) -> None:
        """Stop stepping, fail in-flight requests and close the ZMQ sockets (a crash looks the same)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self._fail_all()
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None

    async def restart(self) -> None:
        """A fresh engine process on the same ports: empty cache, KV-event seq from 0, requests lost."""
        await self.stop()
        self.sched = self._new_scheduler()
        self.generation += 1
        self.started_at = time.time()
        await self.start()

    def _fail_all(self) -> None:
        for req in list(self.sched.running) + list(self.sched.waiting):
            self.sched.abort(req)
            w: Waiters = req.listener
            for f in (w.first, w.done):
                if not f.done():
                    f.set_exception(EngineDead(self.name))
                    f.exception()  # mark retrieved: nobody may be waiting any more

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def apply_faults(self) -> None:
        f = self.faults
        self.sched.slow_factor = max(f.slow_factor, 1e-6)
        if self.publisher is not None:
            self.publisher.delay_s = max(0.0, f.event_delay_ms / 1000.0)
            self.publisher.loss = min(max(f.event_loss, 0.0), 1.0)
        if f.hang:
            self._unhang.clear()
        else:
            self._unhang.set()

    async def wait_unhung(self) -> None:
        if self.faults.hang:
            await self._unhang.wait()

    # ------------------------------------------------------------------ requests
    def lora_id(self, name: str | None) -> int | None:
        if not name:
            return None
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)

    def submit(self, prompt_ids: list[int], max_tokens: int, *, stop_reason: str = "length",
               cache_salt: str | None = None, lora_name: str | None = None, priority: int = 0,
               seed: int = 0) -> SimRequest:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.present_as == "sglang":
            priority = -priority  # SGLang runs higher values first; the scheduler orders lower first
        req = SimRequest(rid=f"{self.name}-{next(self._ids)}", prompt_len=len(prompt_ids), tokens=list(prompt_ids),
                         max_tokens=max_tokens, stop_reason=stop_reason, cache_salt=cache_salt,
                         lora_name=lora_name, lora_id=self.lora_id(lora_name), priority=priority, arrival=now,
                         seed=seed)
        req.listener = Waiters(loop.create_future(), loop.create_future(), now)
        self.sched.add(req)
        self._wake.set()
        return req

    def record_truth(self, req: SimRequest) -> None:
        """Keep a finished or aborted request's true cost for /sim/costs (bounded, oldest dropped)."""
        self.costs[req.external_id or req.rid] = req.true_s
        while len(self.costs) > 50_000:
            self.costs.popitem(last=False)

    def abort(self, req: SimRequest) -> None:
        if req.status not in (FINISHED, ABORTED):
            self.sched.abort(req)
            self.record_truth(req)
            w: Waiters = req.listener
            for f in (w.first, w.done):
                if not f.done():
                    f.cancel()

    def reset_prefix_cache(self) -> bool:
        # vLLM publishes AllBlocksCleared with the next step's batch (seen in captured traffic), not at once.
        return self.sched.reset_prefix_cache()

    def _publish(self, events: list) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)

    # ------------------------------------------------------------------ the step loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if self.faults.hang:
                await self._unhang.wait()
                deadline = loop.time()
            sched = self.sched
            if not sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            now = loop.time()
            if deadline < now - 0.02:  # fell behind (CPU starved): do not burst to catch up
                deadline = now
            t0 = min(deadline, now) if deadline <= now else now
            plan = sched.schedule(t0)
            w0 = now
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            deadline = t0 + plan.duration
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if sched is not self.sched:
                continue
            if self.faults.hang:  # a hang that started mid-step holds the step's results
                await self._unhang.wait()
            out = sched.commit(plan, deadline)
            sched.stats.busy_wall_s += loop.time() - w0  # > busy_s when the host starves this loop
            for req in out.first_tokens:
                f = req.listener.first
                if not f.done():
                    f.set_result(None)
            for req in out.finished:
                self.record_truth(req)
                f = req.listener.done
                if not f.done():
                    f.set_result(None)
            self._publish(out.events)

    # ------------------------------------------------------------------ views
    def snapshot(self) -> dict[str, object]:
        s = self.sched
        return {"name": self.name, "profile": self.profile.name, "present_as": self.present_as,
                "running": len(s.running),
                "waiting": len(s.waiting), "kv_cache_usage": s.pool.usage(), "free_blocks": s.pool.num_free,
                "cached_blocks": len(s.pool.cached), "generation": self.generation,
                "busy_s": round(s.stats.busy_s, 6), "busy_prefill_s": round(s.stats.busy_prefill_s, 6),
                "busy_wall_s": round(s.stats.busy_wall_s, 6),
                "steps": s.stats.steps,
                "next_seq": self.publisher.next_seq if self.publisher else None,
                "dropped_batches": self.publisher.dropped if self.publisher else 0,
                "faults": self.faults.as_dict()}
