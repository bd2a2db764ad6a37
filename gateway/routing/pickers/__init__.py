"""Routing pickers, one per module: every candidate, best first (contract: gateway/routing/plugin.py). Each
module registers itself (gateway/routing/registry.py)."""
