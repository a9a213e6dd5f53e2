"""What a reader's answer copies from its chunk: repeated spans of at least a few tokens, the
longest from each place, merged and widened to whole sentences; invented text keeps nothing."""

from __future__ import annotations

from flashmemory.pipeline.copied_spans import copied_spans, merge_spans, widen_to_sentences


def test_only_spans_repeated_token_for_token_and_long_enough_count():
    source = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert copied_spans([3, 4, 5, 6, 99, 9, 10], source, min_tokens=4) == [(2, 6)]
    assert copied_spans([3, 4, 5, 99, 9, 10], source, min_tokens=4) == []  # too short: no copy
    assert copied_spans([50, 51, 52, 53, 54], source, min_tokens=2) == []  # invented


def test_the_longest_match_wins_and_touching_spans_merge():
    source = [7, 1, 2, 9, 7, 1, 2, 3, 4, 5]
    assert copied_spans([7, 1, 2, 3, 4], source, min_tokens=3) == [(4, 9)]
    assert merge_spans([(5, 8), (0, 2), (2, 4), (7, 9)]) == [(0, 4), (5, 9)]


def test_a_copy_widens_to_the_sentence_it_is_in():
    pieces = [b" a", b" b", b".", b" c", b" d", b" e", b"!", b" f", None]
    source = [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1]
    # the copy "d e" grows back to the sentence start (after ".") and on to its "!"
    assert widen_to_sentences([(4, 6)], pieces, source, max_tokens=10) == [(3, 7)]
    assert widen_to_sentences([(4, 6)], pieces, source, max_tokens=1) == [(3, 7)]
    assert widen_to_sentences([(4, 5)], pieces, source, max_tokens=0) == [(4, 5)]
    # a control token (no bytes) ends a sentence too
    assert widen_to_sentences([(9, 10)], pieces, source, max_tokens=10) == [(9, 11)]
