"""RandomWorkload: the random multi-sequence operations the stress suites run on one cache, one per `step`.

Sequences are added (some with a pinned span), prefilled in chunks, decoded a token at a time, run together in
batched forwards, read back in RoPE-like orders straight from the levels, demoted and promoted (preemption),
freed when they reach their length or at random, and aborted part-way through a forward. Every few operations the
slot accounting is checked. The mix is a table of weights; a suite adds its own operations to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from flashmemory.kvcache.manager.blocks import Level
from flashmemory.tools.mats.access import PATTERNS, access_order
from flashmemory.tools.mats.accounting import check_accounting
from flashmemory.tools.mats.checker import ShadowChecker
from flashmemory.tools.mats.driver import COLD_ZONE_FAULTS, CacheDriver
from flashmemory.tools.mats.report import ErrorLog

BASE_WEIGHTS = {  # relative frequency of each operation
    "add": 6, "prefill": 12, "decode": 30, "batch": 10, "read": 20, "demote": 3, "promote": 4, "free": 2,
    "abort": 2, "accounting": 4,
}
PIN_PROBABILITY = 0.3  # of a new sequence getting a pinned span (a system prompt, image tokens)
READ_BLOCK_PROBABILITY = 0.25  # of a read also reading one block's every layer (read_block, as moves do)


class RandomWorkload:
    """Owns the choice of the next operation; acts through a CacheDriver and checks reads with a ShadowChecker."""

    def __init__(self, driver: CacheDriver, checker: ShadowChecker, generator: torch.Generator, max_live: int,
                 errors: ErrorLog, counters: Counter[str], weights: dict[str, float] | None = None,
                 extra_ops: dict[str, Callable[[], bool]] | None = None) -> None:
        self.driver = driver
        self.cache = driver.cache
        self.checker = checker
        self.generator = generator
        self.max_live = max_live
        self.errors = errors
        self.counters = counters
        self.ops: dict[str, Callable[[], bool]] = {
            "add": self.op_add, "prefill": self.op_prefill, "decode": self.op_decode, "batch": self.op_batch,
            "read": self.op_read, "demote": self.op_demote, "promote": self.op_promote, "free": self.op_free,
            "abort": self.op_abort, "accounting": self.op_accounting, **(extra_ops or {})}
        weights = dict(BASE_WEIGHTS if weights is None else weights)
        self.names = [name for name in weights if name in self.ops]
        self.weights = torch.tensor([float(weights[name]) for name in self.names])
        self.block_size = driver.geometry.block_size
        self.window_blocks = max(1, self.cache.cfg.active_window // self.block_size)

    # ---- choosing ---------------------------------------------------------------------------------------------

    def step(self) -> str:
        """Run one operation (one that applies now; adding a sequence when none does); returns its name."""
        for seq_id in [s for s, seq in self.driver.live.items() if seq.full and not seq.parked]:
            self.driver.free(seq_id, "sequences_finished")  # a sequence at its length is done, as in the engine
        name = self.names[int(torch.multinomial(self.weights, 1, generator=self.generator))]
        if not self._run(name) and not self._run("add"):
            self._run("decode")
        return name

    def _run(self, name: str) -> bool:
        try:
            done = self.ops[name]()
        except COLD_ZONE_FAULTS as error:  # a read straight from a faulty disk: contained like the engine's
            culprit = getattr(error, "seq_id", None)
            self.driver.contain(error, [culprit] if culprit is not None else [])
            done = True
        except Exception as error:  # noqa: BLE001 - anything else the cache raises is a finding
            self.errors.add("exception", f"{name}: {type(error).__name__}: {error}")
            done = True
        if done:
            self.counters[f"op_{name}"] += 1
        return done

    def _pick(self, items: list[int]) -> int:
        return items[int(torch.randint(0, len(items), (1,), generator=self.generator))]

    def _randint(self, low: int, high: int) -> int:
        """A uniform integer in [low, high]."""
        return int(torch.randint(low, high + 1, (1,), generator=self.generator))

    def _running(self) -> list[int]:
        return [s for s, seq in self.driver.live.items() if not seq.parked and not seq.full]

    def _room(self, seq_id: int) -> int:
        seq = self.driver.live[seq_id]
        return seq.shadow.max_tokens - seq.num_cached

    # ---- operations (each returns False when it does not apply now) --------------------------------------------

    def op_add(self) -> bool:
        if len(self.driver.live) >= self.max_live:
            return False
        span = None
        if float(torch.rand(1, generator=self.generator)) < PIN_PROBABILITY:
            start = self._randint(self.block_size, self.driver.max_tokens // 2)
            span = (start, start + self._randint(1, 2 * self.block_size))
        self.driver.add(span)
        return True

    def op_prefill(self) -> bool:
        running = self._running()
        if not running:
            return False
        seq_id = self._pick(running)
        self.driver.forward([(seq_id, min(self._room(seq_id), self._randint(2, 3 * self.block_size)))])
        return True

    def op_decode(self) -> bool:
        running = self._running()
        if not running:
            return False
        self.driver.forward([(self._pick(running), 1)])
        return True

    def op_batch(self) -> bool:
        running = self._running()
        if len(running) < 2:
            return False
        chosen = torch.randperm(len(running), generator=self.generator)[: self._randint(2, len(running))].tolist()
        work = []
        for i in chosen:  # decodes and prefill chunks flattened into one forward, as the engine batches them
            seq_id = running[i]
            n = 1 if float(torch.rand(1, generator=self.generator)) < 0.7 else self._randint(2, 2 * self.block_size)
            work.append((seq_id, min(n, self._room(seq_id))))
        self.driver.forward(work)
        return True

    def op_read(self) -> bool:
        readable = [s for s, seq in self.driver.live.items() if seq.num_cached >= self.block_size]
        if not readable:
            return False
        seq_id = self._pick(readable)
        blocks = self.cache.blocks.tables[seq_id].blocks
        pattern = PATTERNS[self._randint(0, len(PATTERNS) - 1)]
        indices = access_order(pattern, len(blocks), self.window_blocks, self.generator)
        layer = self._randint(0, self.driver.geometry.num_layers - 1)
        by_level: dict[Level, list[tuple[int, int]]] = {}
        for index in indices:
            for level, slot in blocks[index].slots.items():  # every copy, not only the one attention reads
                by_level.setdefault(level, []).append((index, slot))
        for level, pairs in by_level.items():
            parts = self.cache.levels[level].read_layer([slot for _, slot in pairs], layer)  # [kv_heads, n, ...]
            for j, (index, _) in enumerate(pairs):
                self.checker.check(level, seq_id, index, {n: t[:, j] for n, t in parts.items()}, layer,
                                   f"read_layer ({pattern})")
        if by_level and float(torch.rand(1, generator=self.generator)) < READ_BLOCK_PROBABILITY:
            level = self._pick(sorted(by_level))
            index, slot = by_level[level][self._randint(0, len(by_level[level]) - 1)]
            self.checker.check(level, seq_id, index, self.cache.levels[level].read_block(slot), None, "read_block")
        self.counters[f"reads_{pattern}"] += 1
        return True

    def op_demote(self) -> bool:
        running = [s for s in self._running() if self.driver.live[s].num_cached >= self.block_size]
        if not running:
            return False
        self.driver.demote(self._pick(running))
        return True

    def op_promote(self) -> bool:
        parked = [s for s, seq in self.driver.live.items() if seq.parked]
        if not parked:
            return False
        self.driver.promote(self._pick(parked))
        return True

    def op_free(self) -> bool:
        if not self.driver.live:
            return False
        self.driver.free(self._pick(list(self.driver.live)))
        return True

    def op_abort(self) -> bool:
        running = self._running()
        if not running:
            return False
        seq_id = self._pick(running)
        self.driver.abort(seq_id, min(self._room(seq_id), self._randint(1, 2 * self.block_size)))
        return True

    def op_accounting(self) -> bool:
        result = check_accounting(self.cache)
        self.counters["accounting_checks"] += 1
        self.counters["leaked_slots"] += result.leaked_slots
        for problem in result.problems:
            self.errors.add("leak" if "allocator" in problem else "accounting", problem)
        return True
