"""The routing plugin names as one import (kept for bench/ and older imports). The plugins live one per
module under filters/, scorers/ and pickers/ (score contract: gateway/routing/plugin.py); strategies are built
by gateway/routing/registry.py; the approximate prefix tree is gateway/routing/approx.py."""
from __future__ import annotations

from gateway.routing.approx import ApproxPrefixIndex, text_blocks
from gateway.routing.filters.capacity import ContextFilter
from gateway.routing.pickers.min_score import MinScorePicker
from gateway.routing.pickers.round_robin import RoundRobinPicker
from gateway.routing.plugin import EngineView, Filter, Picker, Scored, Scorer, Strategy
from gateway.routing.registry import PRESETS, build_strategy
from gateway.routing.scorers.load import LoadScorer
from gateway.routing.scorers.predicted_ttft import PredictedTTFTScorer
from gateway.routing.scorers.prefix_hash import PrefixHashScorer
from gateway.routing.scorers.target_fit import TargetFitScorer, target_fit_score

STRATEGIES = PRESETS

__all__ = ["ApproxPrefixIndex", "ContextFilter", "EngineView", "Filter", "LoadScorer", "MinScorePicker", "Picker",
           "PredictedTTFTScorer", "PrefixHashScorer", "RoundRobinPicker", "STRATEGIES", "Scored", "Scorer",
           "Strategy", "TargetFitScorer", "build_strategy", "target_fit_score", "text_blocks"]
