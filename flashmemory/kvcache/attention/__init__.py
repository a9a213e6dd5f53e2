"""Attention over KV: the dense kernels (contiguous cache), the partial-attention merge, and the tiered cache's
backends (torch, native CPU) behind one interface and a registry."""
