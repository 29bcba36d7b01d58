"""Meaning guards: a similar-looking pair is reused only if the facts that flip meaning agree.

Similarity scores miss what users care about most: "the merger was approved" and "the merger was
not approved" share almost every shingle, and so do "revenue rose 5%" and "revenue rose 15%". So a
near or semantic match must also agree on
  - numbers (as a multiset: 5 and 15 differ, "1,000" equals "1000", number words count too),
  - negations (not, no, never, without, n't, ...: counted),
  - named entities (capitalised words that do not start a sentence, acronyms: as a set),
  - length (the longer text at most `max_length_ratio` times the shorter).

Inside a job both texts are at hand, so text added only at the start or the end of one of them
(a forwarded-message header, a mirror's footer) is set aside before comparing, as long as it holds
no negation. Across jobs only the stored features of the earlier text exist, so the whole texts
must agree.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from difflib import SequenceMatcher

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD_NUMBERS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve", "twenty", "thirty", "hundred", "thousand", "million", "billion", "half",
                 "dozen", "first", "second", "third"}
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot",
              "nowhere", "hardly", "barely", "denied", "denies", "deny", "refused", "rejected", "fails", "failed"}
_SENTENCE_END = re.compile(r"[.!?:;\"')\]]$")
_STRIP = ".,;:!?\"'()[]{}<>«»“”‘’"


@dataclass(frozen=True)
class Features:
    numbers: tuple[str, ...]    # sorted multiset
    negations: tuple[str, ...]  # sorted multiset
    entities: tuple[str, ...]   # sorted set
    length: int                 # characters

    def to_json(self) -> str:
        return json.dumps([self.numbers, self.negations, self.entities, self.length], separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Features":
        n, g, e, length = json.loads(text)
        return Features(tuple(n), tuple(g), tuple(e), int(length))


def _token_facts(tokens: list[str]) -> tuple[Counter, Counter, set]:
    numbers: Counter = Counter()
    negations: Counter = Counter()
    entities: set[str] = set()
    previous = ""
    for i, raw in enumerate(tokens):
        word = raw.strip(_STRIP)
        lower = word.lower()
        for n in _NUMBER.findall(word):
            numbers[n.replace(",", "")] += 1
        if lower in _WORD_NUMBERS:
            numbers[lower] += 1
        if lower in _NEGATIONS or lower.endswith("n't"):
            negations["not" if lower.endswith("n't") else lower] += 1
        if word and word[0].isupper() and (i > 0 and not _SENTENCE_END.search(previous) or
                                          (len(word) > 1 and word.isupper())):
            entities.add(word)
        previous = raw
    return numbers, negations, entities


def features(text: str) -> Features:
    """Guard features of a whitespace-normalised text."""
    numbers, negations, entities = _token_facts(text.split())
    return Features(tuple(sorted(numbers.elements())), tuple(sorted(negations.elements())),
                    tuple(sorted(entities)), len(text))


def _length_ok(a: int, b: int, max_ratio: float) -> bool:
    return max(a, b) <= max_ratio * max(min(a, b), 1)


def features_agree(a: Features, b: Features, max_length_ratio: float) -> str | None:
    """None when the two agree; else the first guard that failed (`numbers`, `negation`, `entities`, `length`)."""
    if not _length_ok(a.length, b.length, max_length_ratio):
        return "length"
    if a.numbers != b.numbers:
        return "numbers"
    if a.negations != b.negations:
        return "negation"
    if a.entities != b.entities:
        return "entities"
    return None


def texts_agree(a: str, b: str, max_length_ratio: float, fa: Features | None = None,
                fb: Features | None = None) -> str | None:
    """Like `features_agree`, but text only one side has at its start or end (a header, a footer) is set aside."""
    fa, fb = fa or features(a), fb or features(b)
    failed = features_agree(fa, fb, max_length_ratio)
    if failed is None or failed == "length":
        return failed
    ta, tb = a.split(), b.split()
    ops = SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes()
    edges_a, edges_b = set(), set()  # token positions only one side has, at its start or end
    for op in (ops[0], ops[-1]) if ops else ():
        tag, i1, i2, j1, j2 = op
        if tag in ("delete", "insert"):
            edges_a.update(range(i1, i2))
            edges_b.update(range(j1, j2))
    if not edges_a and not edges_b:
        return failed
    for side, tokens in ((edges_a, ta), (edges_b, tb)):
        if _token_facts([tokens[i] for i in sorted(side)])[1]:
            return "negation"  # an added "not" is never boilerplate
    core_a = _token_facts([t for i, t in enumerate(ta) if i not in edges_a])
    core_b = _token_facts([t for i, t in enumerate(tb) if i not in edges_b])
    for name, x, y in zip(("numbers", "negation", "entities"), core_a, core_b):
        if x != y:
            return name
    return None
