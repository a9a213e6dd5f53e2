"""Copiers for device staging (device_staging.py): asynchronous copies into the staging area, in submission order.

`ThreadCopier` runs them on a background thread (any device; the CPU host's case and the tests'); `CudaStreamCopier`
queues them on a side CUDA stream from pinned host memory and tracks them with events.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) tensors of one submitted copy


class Copier(Protocol):
    """Runs the staging copies asynchronously, in submission order (FIFO).

    `submit` returns a ticket (1, 2, 3, ... in submission order). `done(t)`: every copy up to ticket t completed.
    `wait(t)`: after it returns, the consumer (the calling thread, and on CUDA the current stream) sees the bytes
    of every copy up to ticket t.
    """

    def submit(self, pairs: CopyPairs) -> int: ...

    def done(self, ticket: int) -> bool: ...

    def wait(self, ticket: int) -> None: ...

    def close(self) -> None: ...


class CopierClosedError(RuntimeError):
    """A copy was submitted to, or waited on from, a closed copier (its queued copies were dropped)."""


class ThreadCopier:
    """Owns one background thread that does the copies (`dst.copy_(src)`) in submission order."""

    def __init__(self, name: str = "flashmemory-device-staging") -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, CopyPairs]] = deque()
        self._issued = 0
        self._completed = 0  # every ticket <= this one is done
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, pairs: CopyPairs) -> int:
        with self._cond:
            if self._closed:
                raise CopierClosedError("copier is closed")
            self._issued += 1
            self._queue.append((self._issued, pairs))
            self._cond.notify_all()
            return self._issued

    def done(self, ticket: int) -> bool:
        with self._cond:
            return self._completed >= ticket

    def wait(self, ticket: int) -> None:
        with self._cond:
            if ticket > self._issued:
                raise ValueError(f"ticket {ticket} was never issued (last: {self._issued})")
            while self._completed < ticket:
                if self._error is not None:
                    raise RuntimeError("device staging copy failed") from self._error
                if self._closed:
                    raise CopierClosedError(f"copier closed before ticket {ticket} completed")
                self._cond.wait()

    def close(self) -> None:
        """Drop the queued copies, finish the running one and join the thread."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _copy(self, pairs: CopyPairs) -> None:
        """One submitted copy (a hook for tests that need to hold copies in flight)."""
        for dst, src in pairs:
            dst.copy_(src)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                ticket, pairs = self._queue.popleft()
            try:
                self._copy(pairs)
            except Exception as e:  # handed to the waiting consumer
                logger.exception("device staging copy %d failed", ticket)
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._completed = ticket
                self._cond.notify_all()


class CudaStreamCopier:
    """Owns a side CUDA stream and the events of the copies queued on it (pinned host memory -> device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._events: deque[tuple[int, torch.cuda.Event]] = deque()  # not known to be done yet, in ticket order
        self._issued = 0
        self._completed = 0
        self._closed = False
        self._warned_pageable = False
        self._pinned: dict[int, bool] = {}  # host storage address -> page-locked

    def submit(self, pairs: CopyPairs) -> int:
        if self._closed:
            raise CopierClosedError("copier is closed")
        # After everything queued on the consumer stream: a put's asynchronous write into pinned host memory, and
        # kernels still reading the destination entry from an earlier step.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                base = src.untyped_storage().data_ptr()
                pinned = self._pinned.get(base)
                if pinned is None:
                    pinned = self._pinned[base] = src.is_pinned()
                if not pinned and not self._warned_pageable:
                    self._warned_pageable = True
                    logger.warning("device staging: host KV pool is not pinned; copies to %s are synchronous",
                                   self.device)
                dst.copy_(src, non_blocking=pinned)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._issued += 1
        self._events.append((self._issued, event))
        return self._issued

    def _poll(self) -> None:
        while self._events and self._events[0][1].query():
            self._completed = self._events.popleft()[0]

    def done(self, ticket: int) -> bool:
        self._poll()
        return self._completed >= ticket

    def wait(self, ticket: int) -> None:
        self._poll()
        if self._completed >= ticket:
            return
        for t, event in self._events:  # FIFO: the first event at or after `ticket` covers every earlier copy
            if t >= ticket:
                torch.cuda.current_stream(self.device).wait_event(event)
                return
        raise ValueError(f"ticket {ticket} was never issued (last: {self._issued})")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream.synchronize()
            self._poll()
