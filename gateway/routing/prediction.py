"""Prediction: each candidate's view and predicted TTFT (mean and calibrated upper bound, from arrival), the
features the learner is later fed, and the per-candidate evidence; the plugins order on what this sets."""
from __future__ import annotations

from typing import Mapping, Sequence

from gateway.routing.approx import ApproxPrefixIndex
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView, Scored
from gateway.routing.predictor import Features, Predictor


def predict_candidates(cands: list[Candidate], n_tokens: int, cached: dict[str, int], blocks: list[int],
                       affinity_engine: str | None, elapsed_s: float, target: float | None,
                       views: Sequence[EngineView], predictor: Predictor,
                       approx: ApproxPrefixIndex, setup_s: Mapping[str, float] | None = None
                       ) -> tuple[list[Scored], dict[str, Features]]:
    """Predictions are of the TTFT from arrival: `elapsed_s` (arrival to now) plus the engine learner's
    prediction of the rest (feedback.engine_part), plus what the engine must do before it can start the request
    (`setup_s` per engine: a LoRA adapter's load where it is not resident, gateway/adapters/placement.py).
    `views`: each candidate's engine view now, in order (the prompt's facts are written into it)."""
    items: list[Scored] = []
    feats: dict[str, Features] = {}
    for c, v in zip(cands, views):
        name = c.backend.name
        v.prompt_tokens = n_tokens
        v.cached_tokens = max(0, min(cached.get(name, 0), n_tokens - 1))
        v.approx_match = (approx.match(name, blocks) / len(blocks)) if blocks else 0.0
        v.affinity = affinity_engine == name
        v.ttft_target_ms = target
        f = Features(v.ahead_tokens, n_tokens - v.cached_tokens, v.running)  # (ahead, uncached, running)
        feats[name] = f
        mean, upper = predictor.predict(name, f)
        setup = setup_s.get(name, 0.0) if setup_s else 0.0
        c.predicted_ttft_ms = round((elapsed_s + setup + mean) * 1000, 3)
        c.predicted_ttft_upper_ms = round((elapsed_s + setup + upper) * 1000, 3)
        c.cached_tokens = v.cached_tokens
        c.info = {"predicted_ttft_upper_ms": c.predicted_ttft_upper_ms, "ahead_tokens": int(v.ahead_tokens),
                  "running": v.running, "waiting": v.waiting, "inflight": v.inflight,
                  "operator": c.backend.operator}
        if setup:
            c.info["adapter_load_ms"] = round(setup * 1000, 3)
        items.append(Scored(c, v))
    return items, feats
