"""Graceful shutdown: on SIGTERM or SIGINT stop admitting, let running requests finish within shutdown_timeout_s,
end the rest with an error (streams: an error chunk, then `data: [DONE]`), and only then let uvicorn stop.

uvicorn's own shutdown closes the listening socket at once and, after timeout_graceful_shutdown, cancels the tasks
still sending a response: a stream would stop mid-body with neither an error nor [DONE]. So the signal is taken
here first. While the drain runs the server still accepts connections and answers 503 with Retry-After (GET /health
says "shutting down", so a load balancer stops sending traffic); once every response is complete, uvicorn's
shutdown has nothing left to cut, then the lifespan stops the engine thread.

A second signal ends the running requests at once; a third exits without waiting (uvicorn's force exit).
SIGTERM then exits 0; SIGINT is re-raised after the shutdown, as uvicorn does (exit 130 from the command line).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from flashmemory.serve.state import ServerState

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the drain looks at what is still running
FLUSH_TIMEOUT_S = 5.0  # time the ended requests get to send their error and [DONE]


class Drain:
    """Owns one shutdown of the server's requests: refuse new ones, wait for the running ones, end the rest."""

    def __init__(self, state: ServerState, timeout_s: float) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self._hurry = False

    def hurry(self) -> None:
        """End the running requests now instead of at the deadline (a second signal)."""
        self._hurry = True

    async def run(self) -> None:
        state = self.state
        state.shutting_down = True
        if state.num_pending:
            logger.info("shutting down: waiting up to %.0f s for %d running sequence(s) (--shutdown-timeout-s)",
                        self.timeout_s, state.num_pending)
        finished = await self._wait(lambda: state.num_pending == 0, self.timeout_s)
        if not finished:
            streams = list(state.streams)
            logger.warning("shutting down: ending %d request(s) (%d sequence(s)) still running after %.0f s",
                           len(streams), state.num_pending, self.timeout_s)
            for stream in streams:
                stream.end(state.shutting_down_error(
                    f"the server shut down before this request finished (--shutdown-timeout-s {self.timeout_s:g})"))
        # The responses still have to send their last chunk (a finished one, or the error and [DONE]).
        await self._wait(lambda: not state.streams, FLUSH_TIMEOUT_S, hurry=False)

    async def _wait(self, done: Callable[[], bool], timeout_s: float, hurry: bool = True) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline or (hurry and self._hurry):
                return False
            await asyncio.sleep(_POLL_S)
        return True


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, with a Drain of the app's requests between the first signal and uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.drain = Drain(state, state.config.shutdown_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def begin_shutdown(self) -> None:
        """Start the graceful shutdown (what SIGTERM does); callable from any thread."""
        if self._loop is None or not self.started:
            self.should_exit = True  # not serving yet: nothing to drain
            return
        self._loop.call_soon_threadsafe(self._on_request_to_stop)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: runs as a Python signal handler on the main thread, i.e. between two steps of the event loop.
        # uvicorn re-raises the signals in its _captured_signals once it has shut down (as its own handle_exit
        # records them): SIGINT is kept there, so Ctrl-C still ends as KeyboardInterrupt (exit 130); SIGTERM is
        # not, so a drained server exits 0 instead of being killed by the re-raised signal.
        if sig == signal.SIGINT and sig not in self._captured_signals:
            self._captured_signals.append(sig)
        self.begin_shutdown()

    def _on_request_to_stop(self) -> None:
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain_then_exit())
        elif not self._draining.done():
            logger.info("shutting down: ending the running requests now (signal received again)")
            self.drain.hurry()
        else:
            self.force_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        except Exception:  # noqa: BLE001 - whatever happened, the server must still stop
            logger.exception("the graceful shutdown failed; stopping anyway")
        self.should_exit = True
