"""Client wire APIs: how each API the gateway serves speaks on the wire (usage, response facts, stream rules,
error shape). One module per API; an `Endpoint` (gateway/api/endpoints.py) names the wire it speaks."""
