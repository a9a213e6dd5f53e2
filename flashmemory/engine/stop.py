"""StopStringMatcher: finds stop strings in streamed text, holding back only what could still become one."""

from __future__ import annotations


class StopStringMatcher:
    """Owns the not-yet-emitted tail of a stream; releases text that can no longer be part of a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a decoded piece; return the text that is safe to emit. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        if not self.stop:
            return piece
        self._pending += piece
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            out, self._pending = self._pending[: min(hits)], ""
            return out
        hold = 0
        for s in self.stop:
            # Longest proper prefix of `s` that the pending text ends with.
            for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                if self._pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation: everything still held back (it did not turn into a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
