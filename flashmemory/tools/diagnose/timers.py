"""Timers around the model's parts for one diagnose run: the projections (dense or in a GGUF block format), the
embedding lookup and the LM head (weights), the cache's attend (attention), its query-aware choice (selection)
and the moves and reads between levels (transfers). Every timer records exclusive time (a timer inside another
is subtracted from the outer one), so the phases of a step add up; what no timer covers is overhead (norms,
RoPE, activations, sampling, scheduling, Python).

The timers are installed on the engine's objects for the run only (module hooks, instance attributes) and removed
afterwards; nothing outside the run is changed. On a GPU each timer synchronizes the device, so the phases are
true but the step is slower than without them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from flashmemory.model.linear import QuantizedEmbedding, QuantizedLinear

PHASES = ("weights", "attention", "selection", "transfers", "overhead")
# What each measured part counts as (the parts are kept apart in the JSON report).
PART_PHASE = {
    "linear": "weights", "embedding": "weights", "lm_head": "weights",
    "attend": "attention",
    "choose": "selection",
    "l2_read": "transfers", "write_blocks": "transfers", "place_blocks": "transfers", "step_end": "transfers",
    "preempt_moves": "transfers",
}


@dataclass
class PhaseClock:
    """Owns the exclusive time of each part, for the step being measured and summed per kind of step."""

    sync: Callable[[], None] = lambda: None  # torch.cuda.synchronize on a GPU
    thread_id: int = field(default_factory=threading.get_ident)  # only the engine thread is timed
    events: int = 0  # timers entered (their own cost is part of overhead)
    _stack: list[list] = field(default_factory=list)  # [part, start, time in children]
    step: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if threading.get_ident() != self.thread_id:  # a prefetch thread: off the step's critical path
            yield
            return
        self.sync()
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        self.events += 1
        try:
            yield
        finally:
            self.sync()
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.step[name] = self.step.get(name, 0.0) + elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed

    def begin(self, name: str) -> None:
        """Open a part that a hook closes (module pre-hook / hook pairs)."""
        if threading.get_ident() == self.thread_id:
            self.sync()
            self._stack.append([name, time.perf_counter(), 0.0])
            self.events += 1

    def end(self, name: str) -> None:
        if threading.get_ident() != self.thread_id or not self._stack or self._stack[-1][0] != name:
            return
        self.sync()
        frame = self._stack.pop()
        elapsed = time.perf_counter() - frame[1]
        self.step[name] = self.step.get(name, 0.0) + elapsed - frame[2]
        if self._stack:
            self._stack[-1][2] += elapsed

    def take_step(self) -> dict[str, float]:
        """The parts of the step just measured (seconds), and a fresh start for the next."""
        out, self.step = self.step, {}
        return out


def timer_cost_s(samples: int = 20000) -> float:
    """What one timer costs (entering and leaving), to say how much of the overhead is the measurement's own."""
    clock = PhaseClock()
    started = time.perf_counter()
    for _ in range(samples):
        with clock.part("x"):
            pass
    return (time.perf_counter() - started) / samples


def _weights_part(module: torch.nn.Module) -> str | None:
    """"linear" or "embedding" for a module that multiplies by or looks up weights, dense or in a GGUF block
    format (QuantizedLinear / QuantizedEmbedding are not nn.Linear / nn.Embedding: the CPU's default model)."""
    if isinstance(module, (torch.nn.Linear, QuantizedLinear)):
        return "linear"
    if isinstance(module, (torch.nn.Embedding, QuantizedEmbedding)):
        return "embedding"
    return None


def _wrap(obj: Any, method: str, clock: PhaseClock, part: str, stack: ExitStack) -> None:
    """Time obj.method as `part` through an instance attribute, removed when the stack closes."""
    original = getattr(obj, method)

    def timed(*args, **kwargs):
        with clock.part(part):
            return original(*args, **kwargs)

    own = method in vars(obj)  # an instance attribute already (restore it) or the class's method (drop ours)
    setattr(obj, method, timed)
    stack.callback(lambda: setattr(obj, method, original) if own else delattr(obj, method))


@contextmanager
def instrument(engine, clock: PhaseClock) -> Iterator[dict[str, int]]:
    """Install the timers on `engine` for the duration of the block. Yields a dict the model's forward fills with
    the number of tokens of the last forward (a step is prefill when it is more than one)."""
    model, cache = engine.model, engine.cache
    last = {"tokens": 0}
    with ExitStack() as stack:
        for module in model.modules():
            name = _weights_part(module)
            if name is None:
                continue
            stack.callback(module.register_forward_pre_hook(lambda m, a, n=name: clock.begin(n)).remove)
            stack.callback(module.register_forward_hook(lambda m, a, o, n=name: clock.end(n)).remove)
        # The LM head (tied to the embeddings in most small models) is a plain matrix product after the final norm.
        stack.callback(model.norm.register_forward_hook(lambda m, a, o: clock.begin("lm_head")).remove)
        forward = model.forward

        def timed_forward(input_ids, *args, **kwargs):
            last["tokens"] = int(input_ids.shape[0])
            out = forward(input_ids, *args, **kwargs)
            clock.end("lm_head")
            return out

        model.forward = timed_forward
        stack.callback(delattr, model, "forward")
        _wrap(cache, "attend", clock, "attend", stack)
        reader = getattr(cache, "reader", None)
        if reader is not None:
            _wrap(reader, "choose_batch", clock, "choose", stack)
        placement = getattr(cache, "placement", None)
        if placement is not None:
            _wrap(placement, "write_new_block", clock, "write_blocks", stack)
            _wrap(placement, "place", clock, "place_blocks", stack)
            _wrap(placement, "demote_sequence", clock, "preempt_moves", stack)
            _wrap(placement, "promote_sequence", clock, "preempt_moves", stack)
        disk = getattr(cache, "disk_pool", None)
        if disk is not None:
            _wrap(disk, "read_layer", clock, "l2_read", stack)
        prefetcher = getattr(cache, "prefetcher", None)
        if prefetcher is not None:
            _wrap(prefetcher, "read_layer", clock, "l2_read", stack)
            _wrap(prefetcher, "on_step_end", clock, "step_end", stack)
        yield last


def phases_of(parts: dict[str, float], step_s: float) -> dict[str, float]:
    """Seconds per phase (PHASES) of one step: its parts grouped, overhead = the rest of the step."""
    out = {phase: 0.0 for phase in PHASES}
    for part, seconds in parts.items():
        out[PART_PHASE.get(part, "overhead")] += seconds
    out["overhead"] += max(0.0, step_s - sum(v for k, v in out.items() if k != "overhead"))
    return out
