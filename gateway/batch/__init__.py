"""The batch lane: OpenAI Files and Batch API, executed in the fleet's spare capacity (docs/batch.md)."""
