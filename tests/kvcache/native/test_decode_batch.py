"""The batch decode kernel (native/decode_batch.py): one call for several sequences gives each the
same bits as its own DecodeState calls over the same key sets, whatever the batch and thread count,
and refuses shapes outside its limits."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.native import DecodeBatchCall, DecodeState, RecordFormat
from flashmemory.kvcache.native.decode_batch import SOURCE_FIELDS
from tests.kvcache.native.test_native import DIM, GROUP, HEADS, _pool

needs_kernel = pytest.mark.skipif(native.library() is None,
                                  reason="no C compiler: the kernel cannot be built here")


def _key_sets(seed: int, pools: dict) -> list[tuple]:
    """One sequence's key sets, as the native backend adds them: ("dense", k, v) or
    ("records", storage, slots, fmt, table, layer)."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.randn(2, 2, HEADS, 40, DIM, generator=g).half()  # [2, layers, heads, row, D]
    m = 5 + 7 * seed
    sets = [("dense", arena[0, 1, :, :m], arena[1, 1, :, :m])]  # fp16 strided views, read in place
    new = torch.randn(1, HEADS, DIM, generator=g).half().transpose(0, 1)
    sets.append(("dense", new, new))
    four, sixteen, two = pools[4], pools[16], pools[2]
    table = torch.randperm(40, generator=g)[: 6 + 5 * seed]  # a plan's slots
    shared = table.expand(HEADS, -1)  # every head the same slots (head stride 0)
    sets.append(("records", four.storage, shared, RecordFormat.for_pool(four), None, 1))
    chosen = torch.stack([torch.randperm(len(table), generator=g)[: 3 + 4 * seed].sort().values
                          for _ in range(HEADS)])
    sets.append(("records", sixteen.storage, chosen, RecordFormat.for_pool(sixteen), table, 0))
    if seed != 1:  # sequences differ in how many key sets they have
        k, v = torch.randn(HEADS, 17, DIM, generator=g), torch.randn(HEADS, 17, DIM, generator=g)
        sets.append(("dense", k, v))
        slots = torch.stack([torch.randperm(40, generator=g)[:9] for _ in range(HEADS)])
        sets.append(("records", two.storage[1], slots, RecordFormat.for_pool(two), None, None))
    return sets


def _add_sets(target, sets: list[tuple]) -> None:
    """Feed key sets to a DecodeState or a DecodeBatchCall (the same add_* methods)."""
    for kind, *args in sets:
        if kind == "dense":
            target.add_dense(*args)
        else:
            storage, slots, fmt, table, layer = args
            target.add_records(storage, slots, fmt, table=table, layer=layer)


def _own_calls(q: torch.Tensor, sets: list[tuple]) -> torch.Tensor:
    state = DecodeState(native.library(), q, HEADS)
    _add_sets(state, sets)
    return state.output()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_one_batch_call_gives_each_sequence_the_bits_of_its_own_calls(threads):
    pools = {bits: _pool(bits) for bits in (2, 4, 16)}
    sets = [_key_sets(seed, pools) for seed in range(3)]
    q = torch.randn(3, HEADS * GROUP, DIM)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        call = DecodeBatchCall(native.library(), HEADS)
        for seq_sets in sets:
            call.next_sequence()
            _add_sets(call, seq_sets)
        batched = call.attend(q)
        alone = torch.stack([_own_calls(q[b], sets[b]) for b in range(3)])
    finally:
        torch.set_num_threads(before)
    assert len(call.fields) == len(SOURCE_FIELDS) * sum(len(s) for s in sets)
    assert torch.equal(batched, alone)


@needs_kernel
def test_a_sequence_with_only_its_new_token_and_an_empty_batch_are_handled():
    q = torch.randn(1, HEADS * GROUP, DIM)
    k, v = torch.randn(HEADS, 1, DIM), torch.randn(HEADS, 1, DIM)
    call = DecodeBatchCall(native.library(), HEADS)
    call.next_sequence()
    call.add_dense(k[:, :0], v[:, :0])  # an empty row adds nothing
    call.add_dense(k, v)
    out = call.attend(q)
    # one key: every query head of a KV head gets its value
    torch.testing.assert_close(out[0].view(HEADS, GROUP, DIM), v.expand(HEADS, GROUP, DIM))
    empty = DecodeBatchCall(native.library(), HEADS).attend(torch.empty(0, HEADS * GROUP, DIM))
    assert empty.shape == (0, HEADS * GROUP, DIM)


@needs_kernel
def test_a_group_above_the_kernels_limit_is_refused_not_miscomputed():
    heads = 2
    call = DecodeBatchCall(native.library(), heads)
    call.next_sequence()
    call.add_dense(torch.randn(heads, 3, 64), torch.randn(heads, 3, 64))
    with pytest.raises(ValueError, match="outside the decode kernel's limits"):
        call.attend(torch.randn(1, heads * (native.MAX_GROUP + 1), 64))
