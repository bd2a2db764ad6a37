"""Tenant-owned LoRA adapters (issue 38): the registry, source grants and who may call an adapter (docs/adapters.md)."""
