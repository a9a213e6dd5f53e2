"""A progress bar over a suite's seconds (tqdm, on a terminal only) showing operations and errors so far."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

REFRESH_S = 0.5  # the bar is redrawn at most this often


class Progress:
    """Owns one tqdm bar whose position is the seconds elapsed out of the suite's duration."""

    def __init__(self, label: str, duration_s: float, enabled: bool) -> None:
        self.started = time.monotonic()
        self.total = max(1, round(duration_s))
        self.bar = tqdm(total=self.total, desc=label, unit="s", file=sys.stderr, disable=not enabled, leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s {postfix}")
        self._drawn = 0.0

    def update(self, ops: int, errors: int, **extra: object) -> None:
        now = time.monotonic()
        if now - self._drawn < REFRESH_S:
            return
        self._drawn = now
        self.bar.n = min(self.total, now - self.started)
        self.bar.set_postfix({"ops": ops, "errors": errors, **extra}, refresh=True)

    def close(self) -> None:
        self.bar.close()


def default_enabled() -> bool:
    """Draw the bar when a person is watching (stderr is a terminal)."""
    return sys.stderr.isatty()
