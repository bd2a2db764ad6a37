"""Cost engineering: engine time apportioned to the requests it served, priced per backend (docs/cost.md)."""
