"""Which parts of a source a model's answer copies: the spans of source ids the answer repeats, at
least a few tokens long, widened to whole sentences. What the model wrote that is not in the source
is dropped: a small reader that invents a sentence adds nothing."""

from __future__ import annotations

_SENTENCE_ENDS = (b".", b"!", b"?", b"\n", b":", b";")


def copied_spans(output: list[int], source: list[int], min_tokens: int) -> list[tuple[int, int]]:
    """[start, end) spans of `source` that `output` repeats token for token, each at least
    `min_tokens` long (the longest match from each place in `output`), in source order, merged."""
    where: dict[int, list[int]] = {}
    for j, token in enumerate(source):
        where.setdefault(token, []).append(j)
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(output):
        start, length = 0, 0
        for j in where.get(output[i], ()):
            n = 1
            while i + n < len(output) and j + n < len(source) and output[i + n] == source[j + n]:
                n += 1
            if n > length:
                start, length = j, n
        if length >= min_tokens:
            spans.append((start, start + length))
            i += length
        else:
            i += 1
    return merge_spans(spans)


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching spans joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _ends_sentence(piece: bytes | None) -> bool:
    if piece is None:  # a control token ends whatever came before it
        return True
    return piece.rstrip(b" \t").endswith(_SENTENCE_ENDS)


def widen_to_sentences(spans: list[tuple[int, int]], pieces: list[bytes | None],
                       source: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Each span widened to the sentences it touches (`pieces`: each id's bytes), at most
    `max_tokens` further on either side; merged."""
    wide = []
    for start, end in spans:
        left = start
        while left > 0 and start - left < max_tokens and not _ends_sentence(
                _piece(pieces, source[left - 1])):
            left -= 1
        right = end
        while right < len(source) and right - end < max_tokens and not _ends_sentence(
                _piece(pieces, source[right - 1])):
            right += 1
        wide.append((left, right))
    return merge_spans(wide)


def _piece(pieces: list[bytes | None], token_id: int) -> bytes | None:
    return pieces[token_id] if 0 <= token_id < len(pieces) else None
