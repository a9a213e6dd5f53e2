"""Seed 004 §6's twelve tuning actions (written for transformers and vLLM on a GPU), mapped onto FlashMemory's
settings: what each becomes here, or why it does not apply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedAction:
    """One of seed 004's tuning actions and its counterpart here."""

    number: int
    action: str  # the seed's action, in English
    settings: tuple[str, ...]  # the settings that carry it here (empty: it does not apply)
    here: str  # what to do here, or why it does not apply


SEED_ACTIONS = (
    SeedAction(1, "one dtype for the whole model (model.to(fp16), no autocast)", ("dtype", "kv_precision"),
               "dtype sets the compute type of every layer (float32 on a CPU, bfloat16 on CUDA by default; norms are "
               "computed in float32 on purpose); KV precision is per level (kv_precision), not the model's dtype"),
    SeedAction(2, "KV page granularity (vLLM BLOCK_SIZE 8 / 32)", ("block_size",),
               "block_size (8-128 tokens or 'auto': 16 up to 8K, 32 up to 32K, else 64); smaller blocks select more "
               "finely, larger ones keep block tables and digests short"),
    SeedAction(3, "gradient checkpointing at chosen modules", (),
               "does not apply: FlashMemory only runs inference, there is no gradient path"),
    SeedAction(4, "preallocate the cold-cache file on the SSD (dd)", ("cold_zone_dir", "cold_zone_gb"),
               "the L2 file is created at its full size at start-up (sparse, so only written blocks take disk); put "
               "cold_zone_dir on a local SSD; `flashmemory doctor` measures its IOPS (the seed's 50K rule)"),
    SeedAction(5, "preallocate the warm cache (unified / pinned host memory)", ("cpu_memory_gb",),
               "the L1 pool is allocated once at start-up (cpu_memory_gb; pinned with CUDA), never grown at run time"),
    SeedAction(6, "avoid CUDA graphs' implicit memory", (),
               "does not apply: FlashMemory captures no CUDA graphs"),
    SeedAction(7, "compress the page table (int64 -> int32)", (),
               "does not apply: block tables are host-side lists (one entry per block and level, a few bytes); no "
               "page table lives in device memory"),
    SeedAction(8, "fuse LoRA weights on the device", (),
               "does not apply: LoRA adapters are not supported"),
    SeedAction(9, "truncate RAG context by query length", ("semantic_truncate_threshold", "warm_budget_tokens",
                                                           "max_seq_len"),
               "nothing is truncated: query-aware selection reads warm_budget_tokens of L1 and "
               "semantic_truncate_threshold of L2 per decode step; max_seq_len bounds the context"),
    SeedAction(10, "choose the attention kernel (FlashAttention 2 / 3)", ("attention_backend",),
               "attention_backend: 'auto' picks the native C decode kernel on a CPU where it builds, else torch's "
               "fused attention; a CUDA kernel is one file in kvcache/attention/ (not written yet)"),
    SeedAction(11, "batch host-device transfers", ("prefetch_strategy", "device_staging_mb"),
               "prefetch_strategy reads predicted-hot L2 blocks ahead in background threads; device_staging_mb "
               "copies the hottest L1 blocks to a device area ahead of need, batched per step (GPU hosts)"),
    SeedAction(12, "defragment device memory (empty_cache every 100 requests)", (),
               "does not apply: the KV pools are preallocated slots and any free slot takes any block, so they never "
               "fragment into unusable pieces (diagnose reports their holes); activations are bounded by "
               "prefill_chunk_tokens"),
)
