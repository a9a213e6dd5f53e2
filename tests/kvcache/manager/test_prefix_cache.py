"""The prefix cache's control plane (no torch): names, matches, reuse by reference, LRU eviction, and 1,000
requests with shared prefixes and random aborts leaving no block leaked or freed twice on any level."""

from __future__ import annotations

import random

from flashmemory.kvcache.manager.blocks import BlockManager, Level
from flashmemory.kvcache.manager.prefix_cache import PrefixCache, chain_hashes

BS = 4


def test_names_chain_over_blocks_and_depend_on_the_namespace():
    tokens = list(range(12))
    a = chain_hashes(tokens, BS, b"model-a")
    assert len(a) == 3 and len(set(a)) == 3
    assert chain_hashes(tokens, BS, b"model-b") != a  # another model / precision / block size: other names
    assert chain_hashes([99] + tokens[1:], BS, b"model-a")[2] != a[2]  # a change early renames every later block
    assert chain_hashes(tokens[4:], BS, b"model-a", start_hash=a[0]) == a[1:]


def _write(blocks: BlockManager, cache: PrefixCache, seq_id: int, tokens: list[int]) -> None:
    """What the cache does as a sequence's blocks fill: take an L1 slot, name the block."""
    prev = 0
    table = blocks.tables[seq_id]
    for b in range(len(table.blocks), len(tokens) // BS):
        index = blocks.append_block(seq_id)
        blocks.attach(seq_id, index, Level.HOST, blocks.allocate(Level.HOST))
        chunk = tuple(tokens[b * BS : (b + 1) * BS])
        prev = table.blocks[index - 1].block_hash if index else 0
        (name,) = chain_hashes(chunk, BS, cache.namespace, prev)
        cache.register(table.blocks[index], name, chunk)


def test_a_finished_sequence_s_blocks_are_reused_by_reference_and_evicted_least_recent_first():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 6}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, list(range(12)))
    assert blocks.free_sequence(1) == [] and cache.num_unused == 3  # cached, slots held
    blocks.add_sequence(2)
    found = cache.match(list(range(10)))
    assert [b.token_ids for b in found] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for b in found:
        blocks.share(2, b)
    assert cache.num_unused == 1 and found[0].owners == {2}
    assert cache.hit_tokens == 8 and cache.queried_tokens == 10
    freed = blocks.evict_cached(Level.HOST)  # only the third block is unused: it goes
    assert len(freed) == 1 and len(cache) == 2 and blocks.evict_cached(Level.HOST) == []


def test_a_finished_sequence_s_tail_is_evicted_before_its_head():
    """A prefix is reusable only up to its first missing block: eviction takes the newest blocks first, so what
    stays cached is still a prefix."""
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 6}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, list(range(12)))
    blocks.free_sequence(1)
    blocks.evict_cached(Level.HOST)
    assert [b.token_ids for b in cache.match(list(range(13)))] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    blocks.evict_cached(Level.HOST)
    assert [b.token_ids for b in cache.match(list(range(13)))] == [(0, 1, 2, 3)]


def test_a_block_whose_master_copy_was_lost_ends_the_match_only_where_the_prefill_after_it_reads_fp16():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 8}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, list(range(24)))
    blocks.free_sequence(1)
    cache.match(list(range(24)))[1].master_lost = True  # as Placement marks a block whose L1 copy gave way to INT2
    tokens = list(range(25))
    assert len(cache.match(tokens)) == 6  # no rule given: every cached block

    def within(reach: int):  # a prefill that has computed n blocks reads blocks newer than n - reach in FP16
        return lambda i, n: n - 1 - i < reach

    assert len(cache.match(tokens, needs_master=within(4))) == 6  # block 1 is older than the reach from block 6
    # Reach 5 takes block 1 in: the prefix ends before it, and from there block 0 must be precise (it is).
    assert len(cache.match(tokens, needs_master=within(5))) == 1
    cache.match(list(range(24)))[3].master_lost = True
    # Reach 4 from block 6 takes block 3 in: cut at 3; the reach from there takes block 1 in: cut at 1.
    assert len(cache.match(tokens, needs_master=within(4))) == 1
    assert cache.stats()["prefix_cache_lossy_refusals"] == 2
    cache.match(tokens, count=False, needs_master=within(4))
    assert cache.stats()["prefix_cache_lossy_refusals"] == 2  # a lookup that is not counted (the scheduler's)


def test_a_fresh_copy_of_a_block_that_lost_its_master_takes_its_name():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 4, Level.DISK: 4}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, [1, 2, 3, 4])
    blocks.free_sequence(1)
    (lossy,) = cache.match([1, 2, 3, 4])
    lossy.master_lost = True
    blocks.add_sequence(2)  # computes the same tokens again (the match was cut there)
    index = blocks.append_block(2)
    blocks.attach(2, index, Level.HOST, blocks.allocate(Level.HOST))
    fresh = blocks.tables[2].blocks[index]
    freed = blocks.register(fresh, lossy.block_hash, (1, 2, 3, 4))
    assert freed == [(Level.HOST, 0)] and not lossy.slots and cache.match([1, 2, 3, 4]) == [fresh]
    assert blocks.register(fresh, fresh.block_hash, (1, 2, 3, 4)) == []  # a precise or used block stays put


def test_a_name_collision_never_serves_other_tokens():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 4}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, [1, 2, 3, 4])
    entry = blocks.tables[1].blocks[0]
    entry.token_ids = (9, 9, 9, 9)  # as if another prefix had the same name
    assert cache.match([1, 2, 3, 4, 5]) == []


def test_1000_requests_with_shared_prefixes_and_random_aborts_leak_nothing():
    rng = random.Random(0)
    cache = PrefixCache(BS, b"ns")
    levels = {Level.HOST: 64}
    blocks = BlockManager(levels, cache)
    documents = [[rng.randrange(100) for _ in range(40)] for _ in range(5)]
    live: dict[int, list[int]] = {}
    for request in range(1000):
        if live and rng.random() < 0.5:
            seq_id = rng.choice(list(live))
            blocks.free_sequence(seq_id, keep_cached=rng.random() < 0.9)  # finished, or aborted after a fault
            del live[seq_id]
        tokens = rng.choice(documents)[: rng.randint(5, 40)] + [rng.randrange(100) for _ in range(rng.randint(0, 9))]
        blocks.add_sequence(request)
        for b in cache.match(tokens, (len(tokens) - 1) // BS):
            blocks.share(request, b)
        try:
            _write_with_eviction(blocks, cache, request, tokens)
        except MemoryError:
            blocks.free_sequence(request)  # the level is full of live blocks: this request is refused
            continue
        live[request] = tokens
        _check(blocks, cache, levels)
    for seq_id in list(live):
        blocks.free_sequence(seq_id)
    while blocks.evict_cached(Level.HOST):
        pass
    assert blocks.allocators[Level.HOST].num_used == 0 and len(cache) == 0


def _write_with_eviction(blocks: BlockManager, cache: PrefixCache, seq_id: int, tokens: list[int]) -> None:
    table = blocks.tables[seq_id]
    for b in range(len(table.blocks), len(tokens) // BS):
        slot = blocks.allocate(Level.HOST)
        while slot is None and blocks.evict_cached(Level.HOST):
            slot = blocks.allocate(Level.HOST)
        if slot is None:
            raise MemoryError
        index = blocks.append_block(seq_id)
        blocks.attach(seq_id, index, Level.HOST, slot)
        chunk = tuple(tokens[b * BS : (b + 1) * BS])
        prev = table.blocks[index - 1].block_hash if index else 0
        (name,) = chain_hashes(chunk, BS, cache.namespace, prev or 0)
        cache.register(table.blocks[index], name, chunk)


def _check(blocks: BlockManager, cache: PrefixCache, levels: dict) -> None:
    """Every used slot belongs to exactly one block that a live table or the cache still holds."""
    held = {id(b): b for t in blocks.tables.values() for b in t.blocks}
    held.update({id(b): b for b in cache.index.values()})
    slots = [b.slots[Level.HOST] for b in held.values() if Level.HOST in b.slots]
    assert len(slots) == len(set(slots)), "a slot is held twice"
    assert len(slots) == blocks.allocators[Level.HOST].num_used, "a slot leaked (or was freed while held)"
    for b in held.values():
        owners = {o for o in b.owners if o in blocks.tables}
        assert owners == b.owners, "a block names an owner that is gone"


def test_evicting_the_last_copy_but_an_l0_one_drops_the_block():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.DEVICE: 2, Level.HOST: 2}, cache)
    blocks.add_sequence(1)
    _write(blocks, cache, 1, list(range(4)))
    blocks.attach(1, 0, Level.DEVICE, blocks.allocate(Level.DEVICE))
    blocks.free_sequence(1)
    assert sorted(blocks.evict_cached(Level.HOST)) == [(Level.DEVICE, 0), (Level.HOST, 0)]
    assert len(cache) == 0 and all(a.num_used == 0 for a in blocks.allocators.values())


def test_drop_cached_frees_every_unused_block_and_keeps_the_ones_in_use():
    cache = PrefixCache(BS, b"ns")
    blocks = BlockManager({Level.HOST: 8, Level.DISK: 8}, cache)
    for seq_id, start in ((1, 0), (2, 100)):
        blocks.add_sequence(seq_id)
        _write(blocks, cache, seq_id, list(range(start, start + 12)))
    disk_slot = blocks.allocate(Level.DISK)  # one unused block has a cold copy too
    blocks.tables[1].blocks[0].slots[Level.DISK] = disk_slot
    blocks.free_sequence(1)  # its 3 blocks stay cached; sequence 2's are in use
    freed = blocks.drop_cached()
    expected = [(Level.HOST, s) for s in (0, 1, 2)] + [(Level.DISK, disk_slot)]
    assert sorted(freed) == sorted(expected)
    assert len(cache) == 3 and cache.num_unused == 0
    assert blocks.allocators[Level.HOST].num_used == 3
    assert blocks.allocators[Level.DISK].num_used == 0
    assert cache.match(list(range(12))) == [] and len(cache.match(list(range(100, 112)))) == 3
