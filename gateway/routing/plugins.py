"""Routing plugins, llm-d style: filters drop candidates, scorers score them (lower is better), a picker orders.

Each kind has one interface. A strategy (config `routing.strategy`) is a list of filters, scorers and a
picker; residency is not among them: the stage applies it before any plugin and it cannot be configured away.
Plugins are pure over `EngineView` snapshots built once per request by the stage.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import xxhash

from gateway.routing.plan import Candidate


@dataclass(slots=True)
class EngineView:
    """One candidate's state at routing time (from telemetry when present, else the gateway's own counts)."""

    inflight: int = 0  # this gateway's requests on the engine
    prefilling_tokens: int = 0  # this gateway's dispatched prompt tokens whose first token has not arrived
    running: float = 0.0  # decoding sequences (max of engine metrics and own view)
    waiting: float = 0.0  # requests queued in the engine (metrics)
    kv_usage: float = 0.0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    ahead_tokens: float = 0.0
    approx_match: float = 0.0  # fraction of the prompt the approximate prefix tree saw sent here
    affinity: bool = False  # the session/trace header was last served here
    ttft_target_ms: float | None = None  # the request's TTFT target (x-ttft-slo-ms / policy / default), if any

    @property
    def load(self) -> float:
        return self.inflight + self.waiting + 0.1 * self.running


@dataclass(slots=True)
class Scored:
    cand: Candidate
    view: EngineView
    scores: dict[str, float] = field(default_factory=dict)
    total: float = 0.0


class Filter(Protocol):
    name: str

    def keep(self, s: Scored, prompt_tokens: int) -> str | None:
        """None to keep the candidate, else the reason it is dropped."""


class Scorer(Protocol):
    name: str
    weight: float

    def score(self, items: Sequence[Scored]) -> list[float]: ...


class Picker(Protocol):
    name: str

    def order(self, items: list[Scored]) -> list[Scored]:
        """All items, best first (the Dispatcher falls back along this order)."""


# ------------------------------------------------------------------------------------------------ filters


class ContextFilter:
    """Capacity: the prompt must fit the backend's context window (when declared)."""

    name = "capacity"

    def keep(self, s: Scored, prompt_tokens: int) -> str | None:
        cw = s.cand.backend.context_window
        if cw is not None and prompt_tokens >= cw:
            return f"prompt of ~{prompt_tokens} tokens exceeds context window {cw}"
        return None


# ------------------------------------------------------------------------------------------------ scorers


class PredictedTTFTScorer:
    name = "predicted_ttft"
    weight = 1.0

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [s.cand.predicted_ttft_ms if s.cand.predicted_ttft_ms is not None else 1e12 for s in items]


class LoadScorer:
    name = "load"
    weight = 1.0

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [s.view.load for s in items]


class PrefixHashScorer:
    """SGLang-router style: longest approximate prefix match if it covers enough of the prompt, else least load."""

    name = "prefix_hash"
    weight = 1.0

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def score(self, items: Sequence[Scored]) -> list[float]:
        best = max((s.view.approx_match for s in items), default=0.0)
        if best >= self.threshold:
            return [-s.view.approx_match * 1000 + s.view.load for s in items]
        return [s.view.load for s in items]


class TargetFitScorer:
    """Target-aware placement (best fit): a request with a TTFT target goes to the engine whose calibrated upper
    prediction meets `fill` x the target with the least slack, so a loose-target request lands on a slower or
    busier engine that still serves it in time and the fast engines' headroom stays for tight targets. Engines
    over that line come after every engine under it, by upper prediction; a request without a target is placed
    by predicted TTFT. Scores are in ms (comparable with the picker's affinity slack)."""

    name = "target_fit"
    weight = 1.0

    def __init__(self, fill: float = 0.6) -> None:
        self.fill = fill

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [target_fit_score(s.cand.predicted_ttft_ms, s.cand.predicted_ttft_upper_ms, s.view.ttft_target_ms,
                                 self.fill) for s in items]


def target_fit_score(mean_ms: float | None, upper_ms: float | None, target_ms: float | None,
                     fill: float = 0.8) -> float:
    """Lower is better: the slack (fill x target - upper) of an engine that meets fill x target; 1e6 + upper for
    one that does not; the mean prediction when the request has no target (or no prediction was made)."""
    if target_ms is None or upper_ms is None:
        return mean_ms if mean_ms is not None else 1e12
    line = fill * target_ms
    return line - upper_ms if upper_ms <= line else 1e6 + upper_ms


# ------------------------------------------------------------------------------------------------ pickers


class MinScorePicker:
    """Lowest weighted score first; ties broken by load; a session-affinity engine wins when within slack."""

    name = "min_score"

    def __init__(self, affinity_slack: float = 0.0, affinity_rel: float = 0.0) -> None:
        self.affinity_slack = affinity_slack
        self.affinity_rel = affinity_rel

    def order(self, items: list[Scored]) -> list[Scored]:
        out = sorted(items, key=lambda s: (round(s.total, 6), s.view.load))
        if out and (self.affinity_slack > 0 or self.affinity_rel > 0):
            best = out[0].total
            for i, s in enumerate(out):
                if s.view.affinity and s.total <= best + max(self.affinity_slack, abs(best) * self.affinity_rel):
                    if i:
                        out.insert(0, out.pop(i))
                    break
        return out


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._n = itertools.count()

    def order(self, items: list[Scored]) -> list[Scored]:
        if not items:
            return items
        k = next(self._n) % len(items)
        return items[k:] + items[:k]


@dataclass
class Strategy:
    name: str
    filters: list[Filter]
    scorers: list[Scorer]
    picker: Picker

    def run(self, items: list[Scored], prompt_tokens: int) -> tuple[list[Scored], list[tuple[Scored, str, str]]]:
        """Apply filters, scorers and the picker; returns (ordered kept, [(dropped, filter, reason)])."""
        kept: list[Scored] = []
        dropped: list[tuple[Scored, str, str]] = []
        for s in items:
            why = None
            for f in self.filters:
                why = f.keep(s, prompt_tokens)
                if why is not None:
                    dropped.append((s, f.name, why))
                    break
            if why is None:
                kept.append(s)
        for sc in self.scorers:
            for s, v in zip(kept, sc.score(kept)):
                s.scores[sc.name] = v
                s.total += sc.weight * v
        for s in kept:
            s.cand.score = s.total
        return self.picker.order(kept), dropped


def build_strategy(name: str, affinity_slack_ms: float = 15.0, affinity_rel: float = 0.1) -> Strategy:
    """The named strategy's plugin list (config `routing.strategy`)."""
    filters: list[Filter] = [ContextFilter()]
    if name == "round_robin":
        return Strategy(name, filters, [], RoundRobinPicker())
    if name == "least_loaded":
        return Strategy(name, filters, [LoadScorer()], MinScorePicker())
    if name == "prefix_hash":
        return Strategy(name, filters, [PrefixHashScorer()], MinScorePicker())
    if name == "predicted_ttft":
        return Strategy(name, filters, [PredictedTTFTScorer()], MinScorePicker(affinity_slack_ms, affinity_rel))
    if name == "target_fit":
        return Strategy(name, filters, [TargetFitScorer()], MinScorePicker(affinity_slack_ms, affinity_rel))
    raise ValueError(f"unknown routing strategy {name!r}")


STRATEGIES = ("predicted_ttft", "least_loaded", "round_robin", "prefix_hash", "target_fit")


# ------------------------------------------------------------------------------------------------ approx tree


def text_blocks(text: str, block_chars: int = 256) -> list[int]:
    """Chained hashes of fixed-size text chunks: requests sharing a text prefix share leading hashes."""
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = xxhash.xxh3_64_intdigest(text[i:i + block_chars].encode("utf-8", "surrogatepass"), seed=h)
        out.append(h)
    return out


class ApproxPrefixIndex:
    """What the gateway itself sent where (SGLang's approximate tree): per engine, an LRU of chained block
    hashes. Used by prefix_hash, and by predicted_ttft when there is no KV-event telemetry."""

    def __init__(self, capacity_blocks: int = 50_000) -> None:
        self.capacity = capacity_blocks
        self._by_engine: dict[str, OrderedDict[int, None]] = {}

    def match(self, engine: str, blocks: Sequence[int]) -> int:
        lru = self._by_engine.get(engine)
        if not lru:
            return 0
        n = 0
        for b in blocks:
            if b not in lru:
                break
            n += 1
        return n

    def insert(self, engine: str, blocks: Sequence[int]) -> None:
        lru = self._by_engine.setdefault(engine, OrderedDict())
        for b in blocks:
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
