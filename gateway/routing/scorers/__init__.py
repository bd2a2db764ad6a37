"""Routing scorers, one per module: one float per candidate, lower is better, in the scorer's own `unit`
(contract: gateway/routing/plugin.py). Each module registers itself (gateway/routing/registry.py)."""
