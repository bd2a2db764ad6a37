"""Routing filters, one per module: `keep(scored, prompt_tokens)` returns None or the reason a candidate is
dropped (contract: gateway/routing/plugin.py). Each module registers itself (gateway/routing/registry.py)."""
