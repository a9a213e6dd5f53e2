"""PlacementPolicy (no torch): the rule, its closed-form footprint against a block-by-block count, and the control
plane (block tables, allocators) carrying it out under random load against a plain reference."""

from __future__ import annotations

import random

import pytest

from flashmemory.kvcache.manager.blocks import BlockManager, Level
from flashmemory.kvcache.manager.policy import (BlockLocality, Locality, LocalityPolicy,
                                               PlacementPolicy)


def _policy(rng: random.Random, cold: bool) -> PlacementPolicy:
    return PlacementPolicy(block_size=rng.choice([8, 16]), active_window_tokens=rng.choice([16, 32, 64]),
                           warm_tokens=rng.choice([0, 16, 48]), num_sink_blocks=rng.choice([0, 1, 2]),
                           cold_zone_enabled=cold)


def _counted(policy: PlacementPolicy, num_tokens: int, spans) -> tuple[int, int, int]:
    """The reference: ask the rule about every block and count."""
    n = num_tokens // policy.block_size
    counts = {level: 0 for level in Level}
    for i in range(n):
        for level in policy.levels_for(n - 1 - i, policy.is_pinned(i, spans)):
            counts[level] += 1
    return counts[Level.DEVICE], counts[Level.HOST], counts[Level.DISK]


def test_blocks_age_from_device_to_host_to_disk():
    p = PlacementPolicy(16, active_window_tokens=32, warm_tokens=32, num_sink_blocks=1, cold_zone_enabled=True)
    assert [sorted(lv.name for lv in p.levels_for(age, False)) for age in range(5)] == [
        ["DEVICE", "HOST"], ["DEVICE", "HOST"], ["HOST"], ["HOST"], ["DISK"]]
    assert p.levels_for(100, pinned=True) == {Level.DEVICE, Level.HOST}
    no_cold = PlacementPolicy(16, 32, 32, 1, cold_zone_enabled=False)
    assert no_cold.levels_for(100, False) == {Level.HOST}


def test_sinks_and_spans_are_pinned():
    p = PlacementPolicy(8, 16, 16, num_sink_blocks=1, cold_zone_enabled=True)
    assert p.is_pinned(0) and not p.is_pinned(1)
    assert p.pinned_blocks(10, [(8, 24)]) == {0, 1, 2}
    assert p.pinned_blocks(2, [(8, 24)]) == {0, 1}  # only blocks that exist
    assert list(p.span_blocks(9, 17, 10)) == [1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_footprint_equals_the_rule_applied_to_every_block(seed):
    rng = random.Random(seed)
    policy = _policy(rng, cold=rng.random() < 0.6)
    for _ in range(30):
        tokens = rng.randint(0, 600)
        spans = [(a, a + rng.randint(1, 40)) for a in rng.sample(range(600), rng.randint(0, 3))]
        fp = policy.footprint(tokens, spans)
        assert (fp.device_blocks, fp.host_blocks, fp.disk_blocks) == _counted(policy, tokens, spans)


def test_blocks_move_on_down_a_hierarchy_of_any_length():
    # L2 keeps a block 2 blocks long, L3 one, L4 the rest.
    p = PlacementPolicy(16, active_window_tokens=32, warm_tokens=32, num_sink_blocks=1,
                        cold_zone_enabled=True, keep_tokens=(32, 16))
    assert [sorted(int(lv) for lv in p.levels_for(age, False)) for age in range(9)] == [
        [0, 1], [0, 1], [1], [1], [2], [2], [3], [4], [4]]
    assert p.levels_for(100, pinned=True) == {Level.DEVICE, Level.HOST} and p.num_levels == 5
    assert p.keeps_master(9, 10) and not p.keeps_master(5, 10)
    assert p.keeps_master(0, 10)  # a sink keeps it


@pytest.mark.parametrize("seed", range(20))
def test_footprint_equals_the_rule_over_levels_added_below_the_cold_zone(seed):
    rng = random.Random(seed)
    base = _policy(rng, cold=True)
    keeps = tuple(rng.choice([0, 8, 16, 40]) for _ in range(rng.randint(1, 3)))
    policy = PlacementPolicy(base.block_size, base.active_window_tokens, base.warm_tokens,
                             base.num_sink_blocks, True, keeps)
    for _ in range(30):
        tokens = rng.randint(0, 600)
        spans = [(a, a + rng.randint(1, 40)) for a in rng.sample(range(600), rng.randint(0, 3))]
        n = tokens // policy.block_size
        counted = [0] * policy.num_levels
        for i in range(n):
            for level in policy.levels_for(n - 1 - i, policy.is_pinned(i, spans)):
                counted[level] += 1
        assert list(policy.footprint(tokens, spans).blocks) == counted


class _Mover:
    """A torch-free stand-in for the cache's placement: slots only, no bytes, the same rule."""

    def __init__(self, policy: PlacementPolicy, blocks: BlockManager) -> None:
        self.policy, self.blocks = policy, blocks

    def append(self, seq_id: int, spans) -> None:
        index = self.blocks.append_block(seq_id, pinned=self.policy.is_pinned(len(self.blocks.tables[seq_id].blocks),
                                                                              spans))
        for level in (Level.HOST, Level.DEVICE):
            self.blocks.attach(seq_id, index, level, self.blocks.allocate(level))

    def place(self, seq_id: int) -> None:
        table = self.blocks.tables[seq_id]
        n = len(table.blocks)
        for i, block in enumerate(table.blocks):
            wanted = self.policy.levels_for(n - 1 - i, block.pinned)
            if Level.DISK in wanted and Level.DISK not in block.slots:
                self.blocks.attach(seq_id, i, Level.DISK, self.blocks.allocate(Level.DISK))
            for level in list(block.slots):
                if level not in wanted:
                    self.blocks.detach(seq_id, i, level)


@pytest.mark.parametrize("seed", range(10))
def test_control_plane_under_random_load_holds_exactly_the_policys_footprint(seed):
    rng = random.Random(seed)
    cold = rng.random() < 0.6
    policy = _policy(rng, cold)
    levels = {Level.DEVICE: 10_000, Level.HOST: 10_000} | ({Level.DISK: 10_000} if cold else {})
    blocks = BlockManager(levels)
    mover = _Mover(policy, blocks)
    tokens: dict[int, int] = {}
    spans: dict[int, list] = {}
    reference_slots: dict[Level, set[int]] = {level: set() for level in levels}
    for step in range(400):
        action = rng.random()
        if action < 0.1 or not tokens:
            seq_id = step
            blocks.add_sequence(seq_id)
            tokens[seq_id] = 0
            spans[seq_id] = [(a, a + rng.randint(1, 30)) for a in rng.sample(range(300), rng.randint(0, 2))]
        elif action < 0.2:
            seq_id = rng.choice(list(tokens))
            released = blocks.free_sequence(seq_id)
            for level, slot in released:
                reference_slots[level].discard(slot)
            del tokens[seq_id], spans[seq_id]
            continue
        else:
            seq_id = rng.choice(list(tokens))
        grow = rng.randint(1, 3 * policy.block_size)
        before = tokens[seq_id] // policy.block_size
        tokens[seq_id] += grow
        for _ in range(tokens[seq_id] // policy.block_size - before):
            mover.append(seq_id, spans[seq_id])
        mover.place(seq_id)
        # The allocators hold exactly what the policy says every live sequence holds, and no slot twice.
        expected = {level: 0 for level in levels}
        for sid, n in tokens.items():
            fp = policy.footprint(n, spans[sid])
            for level in levels:
                expected[level] += fp.on(level)
        assert {level: a.num_used for level, a in blocks.allocators.items()} == expected, f"step {step}"
        reference_slots = {level: {b.slots[level] for t in blocks.tables.values() for b in t.blocks
                                   if level in b.slots} for level in levels}
        assert {level: len(s) for level, s in reference_slots.items()} == expected


def _locality_policy(device_blocks: int = 2, host_blocks: int = 2, cold: bool = True):
    # 16-token blocks: window ages 0-1, L1 by age 2-3, the level below from age 4
    return LocalityPolicy(16, active_window_tokens=32, warm_tokens=32, num_sink_blocks=1,
                          cold_zone_enabled=cold, device_blocks=device_blocks,
                          host_blocks=host_blocks)


def _seen(ali: float, steps: int = 100, base: float = 0.1) -> BlockLocality:
    return BlockLocality(ali, steps, history_steps=100, base=base)


def test_locality_bands_place_blocks_within_their_budgets():
    p = _locality_policy()
    n = 12  # blocks 0..11: 0 pinned (sink), 10-11 the window, 8-9 L1 by age, 1-7 below by age
    seen = {0: _seen(0.9), 1: _seen(0.95), 2: _seen(0.8), 3: _seen(0.75),  # 3: no device room
            4: _seen(0.5), 5: _seen(0.4), 6: _seen(0.35),  # 6: no host room left
            7: _seen(0.1), 8: _seen(0.0), 9: _seen(0.0, steps=50), 11: _seen(1.0)}
    roles = p.roles(n, seen, pinned={0})
    assert roles == {1: Locality.DEVICE, 2: Locality.DEVICE, 3: Locality.HOST, 4: Locality.HOST,
                     8: Locality.SINK}  # 9: not a full history yet; 11: in the window
    assert p.levels_for_role(10, False, Locality.DEVICE) == {Level.DEVICE, Level.HOST}
    assert p.levels_for_role(10, False, Locality.HOST) == {Level.HOST}
    assert p.levels_for_role(2, False, Locality.SINK) == {Level.DISK}
    assert p.levels_for_role(10, False, None) == {Level.DISK}  # the age rule
    assert p.levels_for_role(0, False, Locality.SINK) == {Level.DEVICE, Level.HOST}  # window
    # A band asks for twice the share chance gives: with half the candidates chosen, 0.9 is not
    # locality.
    assert p.roles(n, {1: _seen(0.9, base=0.5), 3: _seen(0.5, base=0.3)}, pinned={0}) == {}
    # Without a level below L1 only the device band acts.
    flat = _locality_policy(cold=False)
    assert flat.roles(n, seen, pinned={0}) == {1: Locality.DEVICE, 2: Locality.DEVICE}


@pytest.mark.parametrize("seed", range(20))
def test_locality_footprint_bounds_any_roles_the_policy_gives(seed):
    """Whatever the measured ALIs, the blocks each level holds under locality's roles stay within
    the policy's footprint: the scheduler's capacity checks stay right."""
    rng = random.Random(seed)
    base = _policy(rng, cold=rng.random() < 0.7)
    p = LocalityPolicy(base.block_size, base.active_window_tokens, base.warm_tokens,
                       base.num_sink_blocks, base.cold_zone_enabled,
                       device_blocks=rng.randint(0, 4), host_blocks=rng.randint(0, 4))
    for _ in range(20):
        tokens = rng.randint(0, 600)
        n = tokens // p.block_size
        pinned = p.pinned_blocks(n)
        seen = {i: _seen(rng.choice([0.0, 0.1, 0.5, 0.9]), rng.choice([50, 100]))
                for i in range(n) if rng.random() < 0.7}
        roles = p.roles(n, seen, pinned)
        counts = {level: 0 for level in Level}
        for i in range(n):
            for level in p.levels_for_role(n - 1 - i, i in pinned, roles.get(i)):
                counts[level] += 1
        fp = p.footprint(tokens)
        assert all(counts[lv] <= fp.on(lv) for lv in Level), (counts, fp)
