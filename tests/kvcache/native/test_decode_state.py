"""The decode state's in-place reads: fp16 strided views (the still-filling block), one row of slots for every head
(head stride 0), slots looked up through a table (chosen positions into a plan's slots), a whole pool's storage
addressed by layer, and one state reused across layers: each the same attention as the plain reads."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.native import DecodeState
from tests.kvcache.native.test_native import BLOCK, DIM, GROUP, HEADS, _pool

needs_kernel = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernel cannot be built here")


def _attend(q: torch.Tensor, fill) -> torch.Tensor:
    state = DecodeState(native.library(), q, HEADS)
    fill(state)
    return state.output()


@needs_kernel
def test_fp16_strided_views_read_in_place_equal_their_float_copies():
    torch.manual_seed(0)
    arena = torch.randn(2, 3, HEADS, BLOCK, DIM).half()  # [2, layers, kv heads, block, D], as the filling rows
    k, v = arena[0, 1, :, :11], arena[1, 1, :, :11]  # one layer's first 11 tokens: strided in the head dimension
    new = torch.randn(1, HEADS, DIM).half().transpose(0, 1)  # [heads, 1, D], a transposed view
    q = torch.randn(HEADS * GROUP, DIM)
    in_place = _attend(q, lambda s: (s.add_dense(k, v), s.add_dense(new, new)))
    copies = _attend(q, lambda s: s.add_dense(torch.cat((k, new), dim=1).float(), torch.cat((v, new), dim=1).float()))
    torch.testing.assert_close(in_place, copies, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_shared_slots_tables_and_layer_addressing_equal_explicit_slots():
    pool = _pool(4)
    fmt = native.RecordFormat.for_pool(pool)
    q = torch.randn(HEADS * GROUP, DIM)
    table = torch.randperm(40)[:20]  # a plan's slots
    chosen = torch.stack([torch.randperm(20)[:7].sort().values for _ in range(HEADS)])  # positions per head
    explicit = _attend(q, lambda s: s.add_records(pool.storage[1], table[chosen], fmt))
    looked_up = _attend(q, lambda s: s.add_records(pool.storage, chosen, fmt, table=table, layer=1))
    # With more than one thread the blocks' chunks go to whichever thread is free: the merge order, so the last
    # bits, may differ from run to run.
    torch.testing.assert_close(looked_up, explicit, rtol=1e-5, atol=1e-6)
    shared = _attend(q, lambda s: s.add_records(pool.storage, table.expand(HEADS, -1), fmt, layer=1))
    copied = _attend(q, lambda s: s.add_records(pool.storage[1], table.expand(HEADS, -1).contiguous(), fmt))
    torch.testing.assert_close(shared, copied, rtol=1e-5, atol=1e-6)


@needs_kernel
def test_a_reset_state_forgets_what_it_folded():
    torch.manual_seed(2)
    q1, q2 = torch.randn(HEADS * GROUP, DIM), torch.randn(HEADS * GROUP, DIM)
    k, v = torch.randn(HEADS, 9, DIM), torch.randn(HEADS, 9, DIM)
    state = DecodeState(native.library(), q1, HEADS)
    state.add_dense(torch.randn(HEADS, 30, DIM) * 5, torch.randn(HEADS, 30, DIM))
    first = state.output()
    state.reset(q2)
    state.add_dense(k, v)
    torch.testing.assert_close(state.output(), _attend(q2, lambda s: s.add_dense(k, v)), rtol=0, atol=0)  # 1 thread
    assert not torch.equal(first, state.output())
