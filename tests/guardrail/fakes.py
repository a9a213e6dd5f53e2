"""Classifiers for tests: one that flags given words, one that is slow, one that raises."""

from __future__ import annotations

import threading


class FlagWords:
    """Scores 1.0 on label "bad" for a text holding any of `words`, else 0; records every text."""

    name = "flag-words"
    labels = ("bad",)

    def __init__(self, *words: str) -> None:
        self.words = tuple(w.lower() for w in words)
        self.texts: list[str] = []

    def scores(self, text: str) -> dict[str, float]:
        self.texts.append(text)
        return {"bad": 1.0 if any(w in text.lower() for w in self.words) else 0.0}

    def weights_bytes(self) -> int:
        return 0


class Slow(FlagWords):
    """Answers after `delay_s` (or when released), counting its calls."""

    name = "slow"

    def __init__(self, delay_s: float, *words: str) -> None:
        super().__init__(*words)
        self.delay_s = delay_s
        self.calls = 0
        self.release = threading.Event()

    def scores(self, text: str) -> dict[str, float]:
        self.calls += 1
        self.release.wait(self.delay_s)
        return super().scores(text)


class Raising(FlagWords):
    name = "raising"

    def scores(self, text: str) -> dict[str, float]:
        raise RuntimeError("the classifier broke")

