"""Tools around the engine: eval, bench, access traces, the configuration reference, flashmemory-test."""
