"""The shared layout: every trial of one length and seed hidden in one haystack, each asking one
question.

RULER gives each trial its own haystack; at 32K tokens a CPU prefills one in about 15 minutes, so a
sweep of
tasks x depths would take days. Here all the trials of a length share their haystack: every task's
needles at
every depth are in it (keys drawn without replacement, so each question has one answer), and a trial
is that
haystack plus its own question. The haystack is then prefilled once per configuration (or restored
from a KV
snapshot, needles/prefill_once.py) and every question reuses it through the prefix cache.

What changes against separate haystacks: each question has more distractors (the other trials'
needles; the
number, multikey and multivalue needles share one phrasing), so the tasks are harder, for exact
attention and
every configuration alike; comparisons stay on the same trials. Needles the trials place at one
depth are
spread by SPREAD apart (task by task), so they do not all fall into one KV block.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from flashmemory.errors import ConfigError
from flashmemory.tools.needles.tasks import (
    ANSWER_TOKENS,
    Draws,
    NeedleTrial,
    Question,
    TrialBuilder,
    make_question,
)
from flashmemory.tools.needles.vocabulary import MORE_WORDS, WORDS

SPREAD = (
    0.008  # depth between the needles of two tasks placed at the same depth (0.8 % of the haystack)
)
INTRO = (
    "Special magic numbers, words and uuids, records, tallies and chains of variable assignments "
    "are hidden "
    "in the following text. Memorize them: I will ask about one of them afterwards.\n\n"
)


def _placed(depth: float, task_index: int, num_tasks: int) -> float:
    """Where a task's target needle goes when its trial's depth is `depth`: spread from the other
    tasks'."""
    return min(max(depth + (task_index - (num_tasks - 1) / 2) * SPREAD, 0.005), 0.995)


def build_shared(
    builder: TrialBuilder,
    tasks: Sequence[str],
    length_tokens: int,
    depths: Sequence[float],
    seed: int,
) -> list[NeedleTrial]:
    """One haystack of about `length_tokens` with every (task, depth) trial's needles; one trial
    per pair."""
    rng = random.Random(f"shared|{length_tokens}|{seed}")
    draws = Draws(rng, WORDS + MORE_WORDS)
    asked: list[tuple[str, float, Question]] = []
    for t, task in enumerate(tasks):
        for depth in sorted(depths):
            asked.append(
                (task, depth, make_question(task, rng, _placed(depth, t, len(tasks)), draws))
            )
    enc = lambda s: builder.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    closings = [enc("\n\n" + q.question + builder.tail_text + q.answer_prefix) for _, _, q in asked]
    needles = [
        (i, j, n, enc(n.text)) for i, (_, _, q) in enumerate(asked) for j, n in enumerate(q.needles)
    ]
    head = builder.head_ids + enc(INTRO)
    budget = (
        length_tokens - len(head) - max(map(len, closings)) - sum(len(ids) for *_, ids in needles)
    )
    if budget < len(needles) * 16 or length_tokens > len(builder.text_ids):
        raise ConfigError(
            f"a {length_tokens}-token shared haystack for {len(asked)} trials ({len(needles)} "
            f"needles) needs {len(needles) * 16} to {len(builder.text_ids)} tokens of text, got "
            f"{budget}: use a longer text or length, or fewer tasks or depths"
        )
    start = random.Random(f"haystack|{length_tokens}|{seed}").randint(
        0, len(builder.text_ids) - length_tokens
    )
    body = builder.text_ids[start : start + budget]
    ids, cursor = list(head), 0
    spans: dict[tuple[int, int], tuple[int, int]] = {}
    for i, j, needle, needle_ids in sorted(needles, key=lambda n: n[2].depth):
        cut = max(cursor, int(budget * min(max(needle.depth, 0.0), 1.0)))
        ids += body[cursor:cut]
        cursor = cut
        spans[i, j] = (len(ids), len(ids) + len(needle_ids))
        ids += needle_ids
    ids += body[cursor:]
    trials = []
    for i, ((task, depth, q), closing) in enumerate(zip(asked, closings)):
        targets = [
            spans[i, j] for j, n in enumerate(q.needles) if n.target
        ]  # the one at `depth` first
        trials.append(
            NeedleTrial(
                task,
                length_tokens,
                depth,
                seed,
                ids + closing,
                q.expected,
                ANSWER_TOKENS[task],
                targets,
                shared_prefix_tokens=len(ids),
                question=q.question,
                document_span=(len(head), len(ids)),
            )
        )
    return trials
