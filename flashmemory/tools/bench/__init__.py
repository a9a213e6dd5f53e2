"""`flashmemory bench`: FlashMemory's KV configurations side by side with transformers' caches and llama.cpp."""
