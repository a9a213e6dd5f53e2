"""`flashmemory eval --needles`: RULER-style retrieval trials, their runner and report."""
