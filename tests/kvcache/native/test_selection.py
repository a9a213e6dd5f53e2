"""The native Quest selection chooses what the torch path chooses: GQA groups, hints, a budget of every candidate,
ties (the lower block index wins on both paths), strided digests, and the raw scores the observers see."""

from __future__ import annotations

import pytest
import torch

from flashmemory.kvcache import native
from flashmemory.kvcache.read.hints import boost_hints
from flashmemory.kvcache.read.selection import block_scores, top_blocks

needs_kernel = pytest.mark.skipif(native.library() is None, reason="no C compiler: the kernel cannot be built here")


def _torch_choice(q: torch.Tensor, digest: torch.Tensor, budget: int, indices: torch.Tensor | None = None,
                  hints: torch.Tensor | None = None) -> torch.Tensor:
    scores = block_scores(q, digest)
    return top_blocks(scores if hints is None else boost_hints(scores, indices, hints), budget)


def _kernel() -> native.NativeSelection:
    selection = native.native_selection(torch.device("cpu"))
    assert selection is not None
    return selection


@needs_kernel
@pytest.mark.parametrize("kv_heads,group,head_dim", [(1, 1, 8), (3, 3, 64), (2, 4, 32), (4, 1, 128)])
@pytest.mark.parametrize("budget_share", [0.1, 0.5, 1.0])
def test_native_selection_equals_the_torch_path_on_random_digests(kv_heads, group, head_dim, budget_share):
    torch.manual_seed(kv_heads * 100 + group * 10 + int(budget_share * 10))
    n = 97
    budget = max(1, int(n * budget_share))
    q = torch.randn(kv_heads * group, head_dim)
    keys = torch.randn(kv_heads, n, 2, head_dim)  # two keys per block: centre and radius of their box
    digest = torch.cat(((keys[:, :, 0] + keys[:, :, 1]) / 2, (keys[:, :, 0] - keys[:, :, 1]).abs() / 2), dim=-1)
    scores = torch.empty(kv_heads, n)
    ours = _kernel().select(q, digest, budget, scores=scores)
    assert ours is not None and ours.shape == (kv_heads, budget)
    assert torch.equal(ours, _torch_choice(q, digest, budget))
    torch.testing.assert_close(scores, block_scores(q, digest), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("boxes", [2, 4])
def test_native_selection_with_boxes_equals_the_torch_path(boxes):
    torch.manual_seed(boxes)
    q, digest = torch.randn(9, 64), torch.randn(3, 50, boxes * 128)
    digest[..., 64::128] = digest[..., 64::128].abs()  # radii are not negative
    scores = torch.empty(3, 50)
    ours = _kernel().select(q, digest, 11, scores=scores)
    assert ours is not None and torch.equal(ours, _torch_choice(q, digest, 11))
    torch.testing.assert_close(scores, block_scores(q, digest), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_native_selection_lifts_the_same_hints_as_the_torch_path():
    torch.manual_seed(3)
    q, digest = torch.randn(9, 64), torch.randn(3, 60, 128)
    indices = torch.arange(5, 65) * 2  # logical indices of the level's blocks, ascending, with gaps
    hints = torch.stack([torch.tensor([10, 11, 64, 300]), torch.tensor([128, 128, 20, 22]),
                         torch.tensor([7, 9, 13, 15])])  # some on the level, some between blocks, some past the end
    for budget in (1, 2, 3, 8, 60):
        ours = _kernel().select(q, digest, budget, indices, hints)
        assert torch.equal(ours, _torch_choice(q, digest, budget, indices, hints)), budget
    two = _kernel().select(q, digest, 2, indices, hints)
    assert two[0].tolist() == [0, 27] and two[1].tolist() == [5, 6]  # logical 10 and 64; 20 and 22 (not 128)


@needs_kernel
def test_ties_go_to_the_lower_block_on_both_paths():
    # Integer-valued digests and queries: every sum is exact, so both paths see the same scores, ties included.
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-3, 4, (4, 16), generator=gen).float()
    digest = torch.randint(-2, 3, (2, 50, 32), generator=gen).float()
    digest[:, 10:20] = digest[:, 30:31]  # many blocks of equal score
    digest[:, :, 16:] = digest[:, :, 16:].abs()  # radii are never negative
    for budget in (1, 5, 12, 25, 49, 50):
        ours = _kernel().select(q, digest, budget)
        assert torch.equal(ours, _torch_choice(q, digest, budget)), budget
    flat = torch.zeros(2, 8, 32)  # every score 0 (and -0): the first blocks win
    assert _kernel().select(torch.randn(2, 16), flat, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    indices = torch.arange(8)
    hinted = _kernel().select(torch.randn(2, 16), flat, 2, indices, torch.tensor([[6, 7, 5], [3, 1, 2]]))
    assert hinted.tolist() == [[5, 6], [1, 2]]  # more hints than the budget: the lower hinted blocks


@needs_kernel
def test_a_strided_digest_view_is_read_in_place():
    torch.manual_seed(7)
    store = torch.randn(4, 3, 200, 128)  # [layers, kv heads, capacity blocks, 2 * D], as a sequence keeps it
    view = store[2, :, 40:130]  # one layer's run of blocks: a non-contiguous view
    q = torch.randn(6, 64)
    assert torch.equal(_kernel().select(q, view, 20), _torch_choice(q, view.contiguous(), 20))


@needs_kernel
def test_shapes_outside_the_kernel_fall_back_to_torch():
    selection = _kernel()
    q, digest = torch.randn(4, 16), torch.randn(2, 10, 32)
    assert selection.select(q, digest.double(), 3) is None  # not float32
    assert selection.select(q, digest, 11) is None  # more than there is
    assert selection.select(torch.randn(4, 300), torch.randn(2, 10, 600), 3) is None  # head_dim over the limit


def test_without_the_library_the_cache_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("FLASHMEMORY_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.native_selection(torch.device("cpu")) is None
    finally:
        monkeypatch.delenv("FLASHMEMORY_NATIVE")
        native.library.cache_clear()
    assert native.native_selection(torch.device("meta")) is None  # off the CPU: never the kernel


class _Choices:
    """A choice observer keeping every choice's chosen positions and raw scores."""

    def __init__(self) -> None:
        self.chosen: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []

    def on_choose(self, choice) -> None:
        self.chosen.append(choice.chosen.clone())
        self.scores.append(choice.scores.clone())

    def on_step_end(self, seq_id: int) -> None: ...

    def on_step_abort(self, seq_id: int) -> None: ...


def _decode(native_choice: bool, observe: bool) -> tuple[torch.Tensor, _Choices]:
    from flashmemory.kvcache.tiered import TieredKVCache
    from tests.kvcache.synthetic import QWEN_GEOMETRY, SyntheticSequence, tiny_config

    geometry = QWEN_GEOMETRY  # 7 query heads per KV head, head_dim 64
    cache = TieredKVCache(tiny_config(num_layers=geometry["layers"], num_kv_heads=geometry["kv_heads"],
                                      head_dim=geometry["dim"], kv_precision="fp16", cold_zone_enabled=False,
                                      warm_tokens=400, warm_budget_tokens=32, selection_min_tokens=0,
                                      selection_prompt_tokens=16))
    if not native_choice:
        cache.reader.selection_kernel = None
    observer = _Choices()
    if observe:
        cache.choice_observers.append(observer)
    seq = SyntheticSequence(0, 230, seed=11, **geometry)
    cache.add_sequence(0)
    seq.forward(cache, 0, 120)
    seq.forward(cache, 120, 200)  # the last prefill chunk sets the hints
    out = torch.cat([seq.forward(cache, t, t + 1) for t in range(200, 230)], dim=1)
    cache.close()
    return out, observer


@needs_kernel
@pytest.mark.parametrize("observe", [False, True])
def test_the_cache_decodes_the_same_with_the_native_choice(observe):
    ours, seen = _decode(native_choice=True, observe=observe)
    reference, expected = _decode(native_choice=False, observe=observe)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert len(seen.chosen) == len(expected.chosen) == (30 * 3 if observe else 0)  # every step and layer chose
    for a, b in zip(seen.chosen, expected.chosen):
        assert torch.equal(a, b)
    for a, b in zip(seen.scores, expected.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_native_selection_reads_fp16_digests_as_the_torch_path_does():
    torch.manual_seed(11)
    q, digest = torch.randn(9, 64), torch.randn(3, 80, 2 * 128).half()
    scores = torch.empty(3, 80)
    ours = _kernel().select(q, digest, 17, scores=scores)
    assert ours is not None and torch.equal(ours, _torch_choice(q, digest, 17))
    torch.testing.assert_close(scores, block_scores(q, digest), rtol=1e-5, atol=1e-5)
