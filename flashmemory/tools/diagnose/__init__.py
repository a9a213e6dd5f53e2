"""`flashmemory diagnose`: the memory pathway of a short measured workload, stage by stage, and advice as
concrete setting changes (seed 004 §2's diagnosis, on our levels; docs/diagnose.md)."""

from flashmemory.tools.diagnose.run import diagnose

__all__ = ["diagnose"]
