"""Meaning guards: a similar-looking pair is reused only if the facts that flip meaning agree.

Similarity scores miss what users care about most: "the merger was approved" and "the merger was
not approved" share almost every shingle, and so do "revenue rose 5%" and "revenue rose 15%". So a
near or semantic match must also agree on
  - numbers (as a multiset: 5 and 15 differ, "1,000" equals "1000", number words count too),
  - negations (not, no, never, without, n't, ...: counted),
  - named entities (capitalised words, as a set: a heuristic with no model; common capitalised
    sentence openers appear on both sides and cancel out),
  - length (the longer text at most `max_length_ratio` times the shorter).

Inside a job both texts are at hand: when one text lies whole inside the other (a mirror copy with
a forwarded-message header or a footer), the wrapping is set aside, as long as it holds no negation.
Across jobs only the stored features of the earlier text exist: numbers and negations must agree
exactly, and one text's entities must include the other's (a swap changes both sides).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

NUMBER = re.compile(r"\d+(?:[.,]\d+)*")  # 1,000 and 3.5 are one number each
_WORD_NUMBERS = {
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "twenty",
    "thirty",
    "hundred",
    "thousand",
    "million",
    "billion",
    "half",
    "dozen",
    "first",
    "second",
    "third",
}
_NEGATIONS = {
    "not",
    "no",
    "never",
    "none",
    "nobody",
    "nothing",
    "neither",
    "nor",
    "without",
    "cannot",
    "nowhere",
    "hardly",
    "barely",
    "denied",
    "denies",
    "deny",
    "refused",
    "rejected",
    "fails",
    "failed",
}


@dataclass(frozen=True)
class Features:
    numbers: tuple[str, ...]  # sorted multiset
    negations: tuple[str, ...]  # sorted multiset
    entities: tuple[str, ...]  # sorted set
    length: int  # characters

    def to_json(self) -> str:
        return json.dumps([self.numbers, self.negations, self.entities, self.length], separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Features":
        n, g, e, length = json.loads(text)
        return Features(tuple(n), tuple(g), tuple(e), int(length))


_WORD = re.compile(r"[A-Za-z][A-Za-z']*")
_CAPITALISED = re.compile(r"\b[A-Z][\w&-]*")


def _facts(text: str) -> tuple[Counter, Counter, set]:
    """(numbers, negations, entities) of a text: regexes and C-level counting, no Python loop per word."""
    numbers = Counter(n.replace(",", "") for n in NUMBER.findall(text))
    lowered = text.lower()
    words = Counter(_WORD.findall(lowered))
    # Set intersections in C rather than a Python test per distinct word.
    numbers.update({w: words[w] for w in words.keys() & _WORD_NUMBERS})
    negations = Counter({w: words[w] for w in words.keys() & _NEGATIONS})
    if "n't" in lowered:
        contracted = sum(c for w, c in words.items() if w.endswith("n't"))
        if contracted:
            negations["not"] += contracted
    # Sentence-initial words count too: "Globex reported" must differ from "Initech reported".
    # Ordinary capitalised openers ("The") appear in both texts alike, so they cancel out.
    entities = set(_CAPITALISED.findall(text))
    return numbers, negations, entities


def features(text: str) -> Features:
    """Guard features of a whitespace-normalised text."""
    numbers, negations, entities = _facts(text)
    return Features(
        tuple(sorted(numbers.elements())), tuple(sorted(negations.elements())), tuple(sorted(entities)), len(text)
    )


def _length_ok(a: int, b: int, max_ratio: float) -> bool:
    return max(a, b) <= max_ratio * max(min(a, b), 1)


def features_agree(a: Features, b: Features, max_length_ratio: float, entity_subset: bool = False) -> str | None:
    """None when the two agree; else the first guard that failed (`numbers`, `negation`, `entities`, `length`).

    `entity_subset`: one side's entities may be a subset of the other's (a header naming a sender),
    for comparisons against stored features, where the texts themselves are not at hand.
    """
    if not _length_ok(a.length, b.length, max_length_ratio):
        return "length"
    if a.numbers != b.numbers:
        return "numbers"
    if a.negations != b.negations:
        return "negation"
    if a.entities != b.entities:
        ea, eb = set(a.entities), set(b.entities)
        if not (entity_subset and (ea <= eb or eb <= ea)):
            return "entities"
    return None


def texts_agree(
    a: str, b: str, max_length_ratio: float, fa: Features | None = None, fb: Features | None = None
) -> str | None:
    """Like `features_agree`, but text only one side has around the other (a header, a footer) is set aside."""
    fa, fb = fa or features(a), fb or features(b)
    failed = features_agree(fa, fb, max_length_ratio)
    if failed is None or failed == "length":
        return failed
    inner, outer = (a, b) if len(a) <= len(b) else (b, a)
    at = outer.find(inner)  # a mirror copy: the whole of one text inside the other
    if at < 0:
        return failed
    if _facts(outer[:at] + " " + outer[at + len(inner) :])[1]:
        return "negation"  # an added "not" is never boilerplate
    return None  # the shorter text's facts are all in the longer one; the rest is its wrapping
