"""Stop strings across streamed pieces: found wherever they split, nothing else withheld."""

from __future__ import annotations

from flashmemory.engine.stop import StopStringMatcher


def _run(pieces, stop):
    m = StopStringMatcher(tuple(stop))
    out = [m.feed(p) for p in pieces]
    return "".join(out) + m.flush(), m.stopped, out


def test_stop_string_split_across_pieces_is_found_and_cut():
    text, stopped, _ = _run(["Hello wor", "ld. ST", "OP here"], ["STOP"])
    assert (text, stopped) == ("Hello world. ", True)


def test_partial_match_is_held_back_then_released():
    text, stopped, out = _run(["abc S", "T", "x"], ["STOP"])
    assert out == ["abc ", "", "STx"]
    assert (text, stopped) == ("abc STx", False)


def test_earliest_of_several_stop_strings_wins():
    text, stopped, _ = _run(["one two three"], ["three", "two"])
    assert (text, stopped) == ("one ", True)


def test_without_stop_strings_everything_passes_through():
    assert _run(["a", "b"], [])[2] == ["a", "b"]
