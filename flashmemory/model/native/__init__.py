"""The model's native kernels (C source in csrc/): GEMV and row dequantization straight from GGUF weight blocks.
Optional: without a C compiler (or with FLASHMEMORY_NATIVE=0) the torch dequantization path runs instead."""
