"""Installing a prompt's blocks from the shared level as cached blocks of this cache.

Before a request is scheduled, the blocks of its prompt past its longest local prefix (never the
last token's block: a prefill computes at least one token) are looked up in the shared level.
The hits are written as a prefill of the same tokens writes them: a placeholder sequence reuses
the local prefix, takes the fetched KV through `append_kv` (every level its copy, its digest, its
name in the prefix cache), and is released, so the blocks stay cached, unused, for the request
the scheduler admits next (the same path as any cached prefix). What cannot be installed (no row
free, a full level) is a miss counted as "capacity"; the request computes those tokens."""

from __future__ import annotations

from typing import Any

import torch

from flashmemory.errors import CapacityError
from flashmemory.kvcache.manager.prefix_cache import chain_hashes

TieredCache = Any  # a TieredKVCache (not imported: it imports this module)

SHARED_SEQ_ID = -2  # the placeholder's id: not a scheduler's (they count up from 0), nor preload's


def import_shared_prefix(cache: TieredCache, token_ids: list[int]) -> int:
    """Install the shared level's blocks of `token_ids` past the local prefix; returns how many."""
    shared, prefix = cache.shared, cache.prefix_cache
    bs = cache.cfg.block_size
    limit = (len(token_ids) - 1) // bs
    if shared is None or prefix is None or limit < 1 or SHARED_SEQ_ID in cache.seqs:
        return 0
    local = prefix.match(token_ids, limit, count=False, needs_master=cache.policy.keeps_master)
    if len(local) >= limit:
        return 0
    start = len(local)
    names = chain_hashes(token_ids[: limit * bs], bs, prefix.namespace,
                         local[-1].block_hash if local else 0, start)
    blocks = [tuple(token_ids[b * bs : (b + 1) * bs]) for b in range(start, limit)]
    found = shared.lookup(names, blocks)
    if not found:
        return 0
    try:
        cache.add_sequence(SHARED_SEQ_ID)
    except CapacityError:  # every row is a live sequence's: this prompt computes its blocks
        shared.record_failure("capacity")
        return 0
    try:
        reused = cache.reuse_prefix(SHARED_SEQ_ID, token_ids[: start * bs + 1], count=False)
        if reused != start * bs:
            return 0  # the local prefix changed under us: nothing to continue from
        keys = torch.cat([k for k, _ in found], dim=2)
        values = torch.cat([v for _, v in found], dim=2)
        end = (start + len(found)) * bs
        cache.importing = True
        try:
            cache.append_kv(SHARED_SEQ_ID, keys, values, token_ids[start * bs : end])
        finally:
            cache.importing = False
    except CapacityError:
        shared.record_failure("capacity")
        return 0
    finally:
        cache.free_sequence(SHARED_SEQ_ID, keep_cached=True)
    shared.installed(len(found))
    return len(found)
