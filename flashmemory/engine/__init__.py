"""The public engine: FlashMemoryEngine, sampling and generation."""
