"""In-flight accounting: the requests this gateway dispatched, per engine, until they finish. A request counts
as prefill work ahead on its engine until its first token (the view drains it at the learned rate). The other
replicas' requests (told by the peer bus, gateway/routing/peers.py) are kept apart as remote flights: the view
counts them, flow control and the learner's feedback (which read `by_engine` / `by_rid`) never see them."""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

from gateway.pipeline import RequestContext
from gateway.routing.predictor import Features


@dataclass(slots=True)
class Flight:
    """A request this gateway dispatched; counts as prefill work ahead until its first token."""

    ctx: RequestContext
    engine: str
    uncached: int
    started: float
    predicted_s: float
    features: dict[str, Features] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    blocks: list[int] = field(default_factory=list)
    telemetry: bool = False
    uppers: dict[str, float] = field(default_factory=dict)  # upper bound (s) admission used, per engine
    elapsed_s: float = 0.0  # time from arrival to the prediction: known, so not the learner's to predict
    flow: str = ""  # its flow in flow control (charged its completion tokens at finish); empty: none
    concurrency: int = 0  # requests in flight on its engine when it was sent, itself included (room.py)

    def prefilling(self, now: float) -> bool:
        if self.ctx.ttft_s is not None:
            return False
        if self.ctx.stream:
            return True
        return now - self.started < self.predicted_s  # non-streamed: the prediction says when prefill ends

    @property
    def is_batch(self) -> bool:
        """A line of the batch lane (gateway/batch), not realtime traffic."""
        return self.ctx.batch is not None


@dataclass(slots=True)
class RemoteFlight:
    """Another replica's request, as its dispatch event told it; `started` is on this process's clock."""

    key: str  # replica/flight id
    replica: str
    engine: str
    uncached: int
    started: float
    predicted_s: float
    stream: bool
    expires: float  # a lost finish still lets it go (peers.PeerState.expire)
    first_token: bool = False

    def prefilling(self, now: float) -> bool:
        if self.first_token:
            return False
        if self.stream:
            return True
        return now - self.started < self.predicted_s


class InFlight:
    """Flights by engine (`by_engine`, read by the view and the batch lane's pacer) and by request id."""

    def __init__(self) -> None:
        self.by_engine: dict[str, dict[str, Flight]] = {}
        self.by_rid: dict[str, Flight] = {}
        self.remote: dict[str, dict[str, RemoteFlight]] = {}  # engine -> key -> the other replicas' flights
        self.remote_by_key: dict[str, RemoteFlight] = {}
        # the remote flights that are long prompts on their engine (the prefill guard counts them): indexed when
        # they arrive, by the threshold the stage sets (flow.limits(engine).long_prompt_tokens)
        self.long_threshold: Callable[[str], int] | None = None
        self.remote_long: dict[str, dict[str, RemoteFlight]] = {}

    def add(self, fl: Flight) -> None:
        rid = fl.ctx.request_id
        self.by_engine.setdefault(fl.engine, {})[rid] = fl
        self.by_rid[rid] = fl

    def pop(self, request_id: str) -> Flight | None:
        """The request's flight, no longer counted (None when it was never dispatched)."""
        fl = self.by_rid.pop(request_id, None)
        if fl is not None:
            self.by_engine.get(fl.engine, {}).pop(request_id, None)
        return fl

    def add_remote(self, rf: RemoteFlight) -> None:
        self.pop_remote(rf.key)
        self.remote.setdefault(rf.engine, {})[rf.key] = rf
        self.remote_by_key[rf.key] = rf
        if self.long_threshold is not None and rf.uncached >= self.long_threshold(rf.engine):
            self.remote_long.setdefault(rf.engine, {})[rf.key] = rf

    def pop_remote(self, key: str) -> RemoteFlight | None:
        rf = self.remote_by_key.pop(key, None)
        if rf is not None:
            fls = self.remote.get(rf.engine)
            if fls is not None:
                fls.pop(key, None)
                if not fls:
                    del self.remote[rf.engine]
            longs = self.remote_long.get(rf.engine)
            if longs is not None and longs.pop(key, None) is not None and not longs:
                del self.remote_long[rf.engine]
        return rf

    def on(self, engine: str) -> list[Flight | RemoteFlight]:
        """Own and remote flights on the engine in dispatch order (what the view drains)."""
        own: list[Flight | RemoteFlight] = list(self.by_engine.get(engine, {}).values())
        rem = self.remote.get(engine)
        if not rem:
            return own
        own.extend(rem.values())
        own.sort(key=_STARTED)  # two runs (nearly) in order: the sort mostly merges
        return own

    def queue(self, engine: str, now: float) -> tuple[int, list[tuple[float, int]], float]:
        """What the view drains (view.queue_view): (requests on the engine, (started, uncached) of those still
        prefilling at `now` in dispatch order, their uncached tokens summed), own and remote flights. Own
        flights are tested inline (`Flight.prefilling`, written out: one method call per flight less)."""
        own = self.by_engine.get(engine)
        if self.remote.get(engine):
            fls = self.on(engine)
            q = [(f.started, f.uncached) for f in fls if f.prefilling(now)]
            n = len(fls)
        else:
            q = []
            if own:
                for f in own.values():
                    c = f.ctx
                    if c.ttft_s is None and (c.stream or now - f.started < f.predicted_s):
                        q.append((f.started, f.uncached))
            n = len(own) if own else 0
        raw = 0.0
        for _, unc in q:
            raw += unc
        return n, q, raw

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.by_engine.items()}


_STARTED = attrgetter("started")
