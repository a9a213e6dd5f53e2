"""The OpenAI-compatible server: `python -m flashmemory.serve` / `flashmemory serve` (see launcher and app)."""
