"""The tiered cache's read path: per-level read plans, Quest selection, choice observers, the block reader."""
