"""RULER-style retrieval trials built from any long text: needles hidden in a haystack, one question
at the end.

Tasks (after RULER, Hsieh et al. 2024; the sentences are our own):
  - number / word / uuid: one needle, "the special magic <kind> for KEY is VALUE", asked for KEY's
  value;
  - multikey: NUM_KEYS needles with different keys, asked for one of them (the others distract);
  - multivalue: NUM_VALUES needles with the same key, asked for all of its values;
  - vartrack: a chain "VAR A = 12345", "VAR B = VAR A", ... asked for every variable holding the
  value;
  - aggregation (RULER's frequent-word extraction): marks in a tally spread over the haystack, asked
  which item
    has the most (the most frequent item's marks around `depth`, the others' anywhere);
  - record (structured extraction): one record of four fields, asked for all of them as JSON.

A trial is token ids ready to feed (chat template applied, the answer's first words already written
as the
assistant, so a small model answers in a few tokens) plus the strings a right answer contains. The
target
needle sits at `depth` of the haystack; other needles at seeded random depths. A haystack is a
window of the
text at a seeded random offset, one per length and seed (as RULER reuses its essays), so trials
share prefixes.
The shared layout (needles/shared.py) hides every trial of a length in one haystack instead.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from flashmemory.errors import ConfigError
from flashmemory.tools.needles.vocabulary import (
    CITIES,
    FIRST_NAMES,
    LAST_NAMES,
    ROLES,
    TALLIES,
    WORDS,
)

TASKS = ("number", "word", "uuid", "multikey", "multivalue", "vartrack", "aggregation", "record")
NUM_KEYS = 4  # needles of the multikey task (one asked for)
NUM_VALUES = 3  # values of the multivalue task's key
NUM_HOPS = 3  # variables in the vartrack chain
TALLY_ITEMS = (
    5  # items of an aggregation tally; the most frequent has TALLY_TOP marks, the others TALLY_REST
)
TALLY_TOP, TALLY_REST = 6, 2
TALLY_SPAN = (
    0.4  # the most frequent item's marks lie within this share of the haystack, centred on `depth`
)
INTRO = {
    task: "Some special magic values are hidden in the following text. Memorize them: I will ask "
    "about one "
    "of them afterwards.\n\n"
    for task in TASKS
}
INTRO["vartrack"] = (
    "Memorize and track the chain of variable assignments hidden in the following text: I will ask "
    "about them afterwards.\n\n"
)
INTRO["aggregation"] = (
    "A tally is kept in the following text: each time one more mark goes to an item. Count the "
    "marks: I will ask which item has the most.\n\n"
)
INTRO["record"] = (
    "A record with several fields is hidden in the following text. Memorize it: I will ask for it "
    "afterwards.\n\n"
)
ANSWER_TOKENS = {
    "number": 12,
    "word": 10,
    "uuid": 32,
    "multikey": 12,
    "multivalue": 36,
    "vartrack": 20,
    "aggregation": 8,
    "record": 40,
}


@dataclass(frozen=True)
class Needle:
    """One sentence hidden in the haystack; `target` marks the one(s) the question is about."""

    text: str
    depth: float  # 0..1 of the haystack's tokens before it
    target: bool


@dataclass
class NeedleTrial:
    """One retrieval question over one haystack, ready to feed."""

    task: str
    length_tokens: int  # intended prompt length (haystack + needles + question)
    depth: float  # where the target needle sits, 0..1
    seed: int
    token_ids: list[int]
    expected: tuple[str, ...]  # every one must appear in the answer
    max_new_tokens: int
    # [start, end) token positions of the target needles, the one at `depth` first
    target_spans: list[tuple[int, int]] = field(default_factory=list)
    # The shared layout: the first tokens, the haystack, are the same in every trial of its length
    # and seed
    shared_prefix_tokens: int = 0
    question: str = ""  # as asked, without the answer's first words
    document_span: tuple[int, int] = (0, 0)  # [start, end) of the haystack text in token_ids

    @property
    def key(self) -> str:
        """Names the trial in reports: task, length, depth, seed."""
        return f"{self.task}/{self.length_tokens}/{self.depth:g}/{self.seed}"


@dataclass(frozen=True)
class Question:
    """A task's needles, its question and the strings a right answer holds."""

    needles: list[Needle]
    question: str
    answer_prefix: str  # the assistant's first words, written for it
    expected: tuple[str, ...]


class Draws:
    """Keys and values drawn without replacement: within one haystack no two needles answer the same
    question
    (a trial draws from its own; the shared layout's trials from one)."""

    def __init__(self, rng: random.Random, words: Sequence[str] = WORDS) -> None:
        self.rng = rng
        self.words = tuple(words)
        self.used: set[str] = set()

    def sample(self, choices: Sequence[str], k: int, what: str) -> list[str]:
        free = [c for c in choices if c not in self.used]
        if len(free) < k:
            raise ConfigError(
                f"one shared haystack ran out of {what} ({len(choices)} in all): ask for fewer "
                "tasks or depths per length, or more --needle-trials-per-cell instead"
            )
        picked = self.rng.sample(free, k) if k > 1 else [self.rng.choice(free)]
        self.used.update(picked)
        return picked

    def key(self) -> str:
        return self.sample(self.words, 1, "key words")[0]

    def keys(self, k: int) -> list[str]:
        return self.sample(self.words, k, "key words")


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _single(task: str, rng: random.Random, depth: float, draws: Draws) -> Question:
    key = draws.key()
    kind = {"number": "number", "word": "word", "uuid": "uuid"}[task]
    if task == "number":
        value = _number(rng)
    elif task == "word":
        value = draws.key()
    else:
        value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    needle = Needle(f" The special magic {kind} for {key} is: {value}. ", depth, True)
    return Question(
        [needle],
        f"What is the special magic {kind} for {key} mentioned in the provided text?",
        f"The special magic {kind} for {key} mentioned in the provided text is",
        (value,),
    )


def _multikey(rng: random.Random, depth: float, draws: Draws) -> Question:
    keys = draws.keys(NUM_KEYS)
    values = [_number(rng) for _ in keys]
    needles = [
        Needle(
            f" The special magic number for {k} is: {v}. ",
            depth if i == 0 else rng.random(),
            i == 0,
        )
        for i, (k, v) in enumerate(zip(keys, values))
    ]
    return Question(
        needles,
        f"What is the special magic number for {keys[0]} mentioned in the provided text?",
        f"The special magic number for {keys[0]} mentioned in the provided text is",
        (values[0],),
    )


def _multivalue(rng: random.Random, depth: float, draws: Draws) -> Question:
    key = draws.key()
    values = [_number(rng) for _ in range(NUM_VALUES)]
    needles = [
        Needle(
            f" One of the special magic numbers for {key} is: {v}. ",
            depth if i == 0 else rng.random(),
            True,
        )
        for i, v in enumerate(values)
    ]
    return Question(
        needles,
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
        tuple(values),
    )


def _vartrack(rng: random.Random, depth: float, draws: Draws) -> Question:
    names = [
        "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(NUM_HOPS)
    ]
    value = str(rng.randint(10000, 99999))
    # The chain reads in order: the first assignment at `depth`, each later one after the one
    # before.
    depths = [depth]
    for _ in range(NUM_HOPS - 1):
        depths.append(depths[-1] + (1 - depths[-1]) * rng.random() * 0.5)
    texts = [f" VAR {names[0]} = {value}. "] + [
        f" VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, NUM_HOPS)
    ]
    needles = [Needle(t, d, True) for t, d in zip(texts, depths)]
    return Question(
        needles,
        f"Find all variables that are assigned the value {value} in the text above.",
        f"Answer: the variables assigned the value {value} are",
        tuple(names),
    )


def _aggregation(rng: random.Random, depth: float, draws: Draws) -> Question:
    """A tally (RULER's frequent-word extraction over natural text): TALLY_TOP marks for one item
    within
    TALLY_SPAN of the haystack around `depth`, TALLY_REST for each other item anywhere; asked for
    the top item."""
    (category,) = draws.sample(list(TALLIES), 1, "tally categories")
    items = rng.sample(TALLIES[category], TALLY_ITEMS)
    low = min(max(depth - TALLY_SPAN / 2, 0.0), 1.0 - TALLY_SPAN)
    # The top item's marks evenly over its span (seeded phase), the one nearest `depth` first among
    # targets.
    phase = rng.random()
    top = sorted(
        (low + TALLY_SPAN * (i + phase) / TALLY_TOP for i in range(TALLY_TOP)),
        key=lambda d: abs(d - depth),
    )
    sentence = " In the {c} tally, one more mark goes to {item}. "
    needles = [Needle(sentence.format(c=category, item=items[0]), d, True) for d in top]
    needles += [
        Needle(sentence.format(c=category, item=item), rng.random(), False)
        for item in items[1:]
        for _ in range(TALLY_REST)
    ]
    return Question(
        needles,
        f"In the {category} tally kept in the provided text, which {category} has the most marks?",
        f"In the {category} tally, the {category} with the most marks is",
        (items[0],),
    )


def _record(rng: random.Random, depth: float, draws: Draws) -> Question:
    """Structured extraction: one record of four fields in one sentence, asked for all of them as
    JSON."""
    rid = draws.sample([str(n) for n in range(1000, 10000)], 1, "record ids")[0]
    first = draws.sample(FIRST_NAMES, 1, "first names")[0]
    name = f"{first} {draws.sample(LAST_NAMES, 1, 'last names')[0]}"
    city = draws.sample(CITIES, 1, "cities")[0]
    code = str(rng.randint(10000, 99999))
    role = rng.choice(ROLES)
    needle = Needle(
        f" Record {rid}: name {name}; city {city}; code {code}; role {role}. ", depth, True
    )
    return Question(
        [needle],
        f"What are the name, city, code and role of record {rid} in the provided text? "
        "Answer as JSON with the keys name, city, code and role.",
        f"Record {rid} as JSON:",
        (name, city, code, role),
    )


def make_question(
    task: str, rng: random.Random, depth: float, draws: Draws | None = None
) -> Question:
    """The task's needles and question; `draws` keeps keys unique across the needles of one
    haystack."""
    draws = draws or Draws(rng)
    if task in ("number", "word", "uuid"):
        return _single(task, rng, depth, draws)
    makers = {
        "multikey": _multikey,
        "multivalue": _multivalue,
        "vartrack": _vartrack,
        "aggregation": _aggregation,
        "record": _record,
    }
    if task not in makers:
        raise ConfigError(f"unknown needle task {task!r}; choose from {', '.join(TASKS)}")
    return makers[task](rng, depth, draws)


class TrialBuilder:
    """Builds trials from one text with one tokenizer (the text is tokenized once)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer = tokenizer
        self.text_ids = tokenizer.encode(text, add_special_tokens=False)
        self.head_ids, self.tail_text = self._template_parts()

    def _template_parts(self) -> tuple[list[int], str]:
        """Token ids before the user's text, and the text between it and the assistant's answer."""
        if not self.tokenizer.has_chat_template:
            return [], "\n"
        marker = "\x00NEEDLE-CONTENT\x00"
        full = self.tokenizer.chat_text(
            [{"role": "user", "content": marker}], add_generation_prompt=True
        )
        head, _, tail = full.partition(marker)
        return self.tokenizer.encode(head, add_special_tokens=False), tail

    def build(self, task: str, length_tokens: int, depth: float, seed: int) -> NeedleTrial:
        rng = random.Random(f"{task}|{length_tokens}|{depth}|{seed}")
        q = make_question(task, rng, depth)
        enc = lambda s: self.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        needle_ids = [enc(n.text) for n in q.needles]
        closing = enc("\n\n" + q.question + self.tail_text + q.answer_prefix)
        budget = (
            length_tokens
            - len(self.head_ids)
            - len(enc(INTRO[task]))
            - len(closing)
            - sum(map(len, needle_ids))
        )
        if budget < 16 or length_tokens > len(self.text_ids):
            raise ConfigError(
                f"a {length_tokens}-token {task} trial needs 16 to {len(self.text_ids)} haystack "
                f"tokens, got {budget}: use a longer text or another length"
            )
        # NOTE: one haystack per (length, seed), whatever the task and depth: trials then share the
        # prompt up to
        # their first needle, which the prefix cache computes once (about half of every prefill).
        start = random.Random(f"haystack|{length_tokens}|{seed}").randint(
            0, len(self.text_ids) - length_tokens
        )
        body = self.text_ids[start : start + budget]
        order = sorted(range(len(q.needles)), key=lambda i: q.needles[i].depth)
        ids, spans, cursor = self.head_ids + enc(INTRO[task]), {}, 0
        document_start = len(ids)
        for i in order:
            cut = max(cursor, int(budget * min(max(q.needles[i].depth, 0.0), 1.0)))
            ids += body[cursor:cut]
            cursor = cut
            spans[i] = (len(ids), len(ids) + len(needle_ids[i]))
            ids += needle_ids[i]
        ids += body[cursor:]
        document_end = len(ids)
        ids += closing
        targets = [
            spans[i] for i, n in enumerate(q.needles) if n.target
        ]  # the one at `depth` first
        return NeedleTrial(
            task, length_tokens, depth, seed, ids, q.expected, ANSWER_TOKENS[task], targets,
            question=q.question, document_span=(document_start, document_end),
        )
