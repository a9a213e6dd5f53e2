"""json_nesting, the byte scan run before parsing: it must count exactly what the parser will
build, however strings and escapes are mixed with brackets."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from flashmemory.serve.body import json_nesting

NASTY_STRINGS = ['a"b', "\\", "[{", '\\"]', "x\\\\", '\\\\"[[', "}]", "caf\u00e9 [", '"', "\\u005b"]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 6 or roll < 0.3:
        return rng.choice([*NASTY_STRINGS, 1, 2.5, None, True])
    if roll < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(NASTY_STRINGS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _reference(value: Any) -> tuple[int, int]:
    """(depth, number of arrays and objects), by walking the parsed value."""
    if isinstance(value, (list, dict)):
        children = [_reference(x) for x in (value.values() if isinstance(value, dict) else value)]
        return 1 + max((d for d, _ in children), default=0), 1 + sum(n for _, n in children)
    return 0, 0


def test_nesting_counts_only_brackets_outside_strings_whatever_the_escapes():
    rng = random.Random(24)
    for _ in range(2000):
        value = _random_value(rng)
        for raw in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            assert json_nesting(raw.encode()) == _reference(value), raw


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a": "\\\\"}', (1, 1)),  # an escaped backslash, then the closing quote
        (b'{"a": "\\\\\\"[", "b": [[]]}', (3, 3)),  # backslash, quote, bracket: all in the string
        (b'{"prompt": "' + b'\\"' * 1000, (1, 1)),  # unterminated: the rest is one string
        (b"[" * 100, (100, 100)),  # unclosed: json.loads would recurse this deep before failing
        (b"", (0, 0)),
    ],
)
def test_nesting_of_escape_runs_and_unterminated_bodies(raw, expected):
    assert json_nesting(raw) == expected
