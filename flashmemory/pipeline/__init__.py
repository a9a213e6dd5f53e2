"""Two models on one task: a small one reads a long document and condenses it, a large one answers
from what it kept (the seeds' hybrid pipeline; the hand-off in token ids through a token bridge)."""

from flashmemory.pipeline.condense import Condensed, CondensePipeline, CondenseSettings

__all__ = ["CondensePipeline", "CondenseSettings", "Condensed"]
