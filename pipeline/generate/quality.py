"""Output quality without a reference model: ROUGE-L against a reference, unfaithful terms, and the
output checks (a degenerate loop, a copied document, a summary off its document's topic).

`rouge_l` scores a summary against a reference summary (the large tier's, or a hold-out label):
the evals and the router's labels use it. `unfaithful_terms` lists what a summary states that its
document does not contain, numbers, dates and capitalised names, so that escalation can send an
output that invents facts to the larger tier. It is a heuristic with no model, and deliberately
conservative: a false positive costs a second generation for nothing, so a word the document holds
in any case, a number it holds in any notation and a date whose parts it holds are never flagged.
It is regular expressions and set look-ups only, fast enough to run on every output.
"""

from __future__ import annotations

import re
import zlib
from functools import cached_property, lru_cache

from pipeline.dedup.guards import NUMBER

_NUMBER = re.compile(NUMBER.pattern + r"%?")
_MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_MONTH_OF = {**{m: i + 1 for i, m in enumerate(_MONTHS)}, **{m[:3]: i + 1 for i, m in enumerate(_MONTHS)}, "sept": 9}
_MONTH = (
    r"(Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sept?(?:ember)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_ORDINAL = r"(?:st|nd|rd|th)?"
# A date is checked as one term (its parts together), before its numbers are checked on their own.
_DATES = (
    re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"),  # ISO: y, m, d
    re.compile(rf"\b{_MONTH}\s+(\d{{1,2}}){_ORDINAL}\b(?:,?\s+(\d{{4}})\b)?"),  # March 3, 2024
    re.compile(rf"\b(\d{{1,2}}){_ORDINAL}\s+(?:of\s+)?{_MONTH}(?:,?\s+(\d{{4}})\b)?"),  # 3 March 2024
    re.compile(rf"\b{_MONTH}\s+(\d{{4}})\b"),  # March 2024
)
_WORD = re.compile(r"[^\W\d_][\w'’&-]*")
_DOC_TOKEN = re.compile(r"\w+")
_HAS_DIGIT = re.compile(r"\d")
_SENTENCE_BREAK = re.compile(r"[.!?:;\n•*()\"“”]|^\s*[-–—]|\s[-–—]\s")
_NUMBER_WORDS = {
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
    "eleven": "11",
    "twelve": "12",
    "twenty": "20",
    "thirty": "30",
    "fifty": "50",
    "hundred": "100",
    "thousand": "1000",
    "million": "1000000",
    "first": "1",
    "second": "2",
    "third": "3",
    "fourth": "4",
    "fifth": "5",
    "dozen": "12",
    "single": "1",
    "once": "1",
    "twice": "2",
    "double": "2",
}
# Capitalised only because they open a sentence (or a heading) in a summary: never names by themselves.
_COMMON = set(
    """
a an the this that these those it its it's there their they them he she his her we our you your i my
in on at for with by from to of as into about over under after before during between through within without
and or but nor so yet if when while because although though since unless until whether then than also
is are was were be been being has have had do does did can could may might must shall should will would
not no yes all any both each every few many more most much other some such only own same very just
here what which who whom whose why how where overall however additionally furthermore moreover finally
first second third next last lastly summary summarised summarized summarizing summarising conclusion
key main note notes important briefly basically essentially specifically generally typically usually
users user developers document documents documentation text file files readme page section sections
package packages program programs software tool tools library module modules function functions class
describes explains provides contains includes lists covers outlines discusses introduces defines
according instead otherwise therefore thus hence please see use using used uses available example
""".split()
)


# Counts of the summary's own structure ("in 3 sentences", "2. The next point"), not facts.
_LIST_MARKER = re.compile(r"(?m)^[ \t>*-]*\(?\d{1,2}[.)]\s")
_STRUCTURE_COUNT = re.compile(
    r"(?i)\b\d{1,2}\s+(?:main\s+|key\s+|short\s+)?(?:sentences?|points?|steps?|paragraphs?"
    r"|items?|parts?|bullets?|words?|lines?|ways?|reasons?|things?|sections?|takeaways?)\b"
)
_MARKUP = re.compile(r"[*_#`>]+")


class _UnicodeWords:
    """Lowercased word tokens in any script (rouge-score's default keeps only [a-z0-9]: a Russian or
    Chinese summary would score 0 against itself)."""

    def tokenize(self, text: str) -> list[str]:
        return _DOC_TOKEN.findall(text.lower())


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer  # imported on first use: escalation without evals never needs it

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_UnicodeWords())


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure of `candidate` against `reference`: 1.0 when both are empty, 0.0 when one is."""
    if not candidate.strip() or not reference.strip():
        return 1.0 if not candidate.strip() and not reference.strip() else 0.0
    return float(_scorer().score(reference, candidate)["rougeL"].fmeasure)


def _number_key(text: str) -> str:
    """One notation per number: no thousands separators, no percent sign, no leading zeros on integers."""
    text = text.rstrip("%").replace(",", "")
    return str(int(text)) if text.isdigit() else text


class _Document:
    """What a summary's terms and words are looked up in, each part computed on first use and once per
    document (`measure` runs every check against one): its words, numbers and months, its word tokens
    in order (copied runs) and its topic words."""

    def __init__(self, text: str):
        self.text = text
        self.lowercase = text.lower()

    @classmethod
    def of(cls, document: str | _Document) -> _Document:
        """The document as read for the checks: as given when `measure` has read it already, else read now."""
        return document if isinstance(document, _Document) else cls(document)

    @cached_property
    def lowered(self) -> str:
        return " ".join(self.lowercase.split())

    @cached_property
    def tokens(self) -> list[str]:
        return _DOC_TOKEN.findall(self.lowercase)

    @cached_property
    def words(self) -> set[str]:
        return set(self.tokens) | {w.strip("'’-") for w in _WORD.findall(self.lowercase)}

    @cached_property
    def numbers(self) -> set[str]:
        numbers = {_number_key(n) for n in _NUMBER.findall(self.text)}
        numbers |= {_NUMBER_WORDS[w] for w in self.words & _NUMBER_WORDS.keys()}
        # A version's leading parts count as present ("2.0" of "2.0.1"): a summary may round it.
        numbers |= {".".join(n.split(".")[:i]) for n in set(numbers) if "." in n for i in range(1, n.count(".") + 1)}
        return numbers

    @cached_property
    def months(self) -> set[int]:
        months = {_MONTH_OF[w] for w in self.words if w in _MONTH_OF}
        return months | {int(m) for _, m, _ in _DATES[0].findall(self.text) if 1 <= int(m) <= 12}  # ISO dates' months

    @cached_property
    def runs(self) -> str:
        """Its tokens joined by single spaces, padded: a run of words is in it iff it is in the text."""
        return f" {' '.join(self.tokens)} "

    @cached_property
    def topic_words(self) -> set[str]:
        return topic_words(self.lowercase)

    def has_word(self, word: str) -> bool:
        w = word.lower().strip("'’-&")
        for suffix in ("'s", "’s"):
            w = w.removesuffix(suffix)
        if not w or w in self.words or w + "s" in self.words or w + "es" in self.words:
            return True
        if w.endswith("s") and w[:-1] in self.words:
            return True
        pieces = [p for p in re.split(r"[-'’&]", w) if p]
        return bool(pieces) and all(p in self.words for p in pieces)

    def has_number(self, text: str) -> bool:
        return _number_key(text) in self.numbers

    def has_month(self, text: str) -> bool:
        name = text.lower().rstrip(".")
        month = _MONTH_OF.get(name) or _MONTH_OF.get(name[:3])
        return month in self.months or (name.isdigit() and (int(name) in self.months or self.has_number(name)))


def _check_dates(summary: str, doc: _Document, flagged: set[str]) -> str:
    """Flag dates whose parts the document lacks; return the summary with every date blanked out."""
    for i, pattern in enumerate(_DATES):
        for m in pattern.finditer(summary):
            if i == 0:
                year, month, day = m.groups()
                ok = doc.has_number(year) and doc.has_month(month) and doc.has_number(day)
            elif i == 3:
                month, year = m.groups()
                ok = doc.has_month(month) and doc.has_number(year)
            else:
                a, b, year = m.groups()
                month, day = (a, b) if i == 1 else (b, a)
                ok = doc.has_month(month) and doc.has_number(day) and (year is None or doc.has_number(year))
            if not ok:
                flagged.add(" ".join(m.group(0).split()))
        summary = pattern.sub(lambda m: " " * len(m.group(0)), summary)
    return summary


def _name_runs(summary: str) -> list[list[str]]:
    """Runs of capitalised words (a multiword name is one run), less their common opening words.

    A run breaks at anything but a single space. A sentence's first word is capitalised whatever it
    is, so alone it counts as a name only when more than its first letter says so ("GNU", "OpenSSL");
    common words ("The", "This README", "Overall") open no name."""
    runs: list[tuple[bool, list[str]]] = []  # (opens a sentence, words)
    run: list[str] | None = None
    initial = False
    last_end = 0
    for m in _WORD.finditer(summary):
        gap, word = summary[last_end : m.start()], m.group(0).rstrip("'’-&")
        at_start = last_end == 0 or bool(_SENTENCE_BREAK.search(gap))
        last_end = m.end()
        if run is not None and (gap != " " or not word[:1].isupper()):
            runs.append((initial, run))
            run = None
        if not word[:1].isupper() or (run is None and word.lower() in _COMMON):
            continue
        if run is None:
            run, initial = [], at_start
        run.append(word)
    if run is not None:
        runs.append((initial, run))
    return [
        run
        for initial, run in runs
        if not (initial and len(run) == 1 and run[0][1:] == run[0][1:].lower() and not _HAS_DIGIT.search(run[0]))
    ]


def _blank(pattern: re.Pattern, text: str) -> str:
    return pattern.sub(lambda m: " " * len(m.group(0)), text)


def _without_headings(text: str) -> str:
    """The text with heading lines and `Label:` openers blanked: small models title their summaries
    ("Key Features:", "Gzip: A Compression Tool") in title case, which says nothing about names."""
    lines = []
    for line in text.split("\n"):
        plain = _blank(_MARKUP, line)
        words = _WORD.findall(plain)
        titled = words and len(words) <= 10 and sum(w[:1].isupper() for w in words) >= 0.6 * len(words)
        if titled and not plain.rstrip().endswith((".", "!", "?")):
            plain = " " * len(plain)
        lines.append(re.sub(r"^[^:\n]{1,40}:(?=\s|$)", lambda m: " " * len(m.group(0)), plain))
    return "\n".join(lines)


def unfaithful_terms(summary: str, document: str | _Document) -> list[str]:
    """Sorted unique numbers, dates and capitalised names that `summary` states and `document` lacks."""
    doc = _Document.of(document)
    flagged: set[str] = set()
    rest = _check_dates(summary, doc, flagged)
    rest = _blank(_STRUCTURE_COUNT, _blank(_LIST_MARKER, rest))
    for m in _NUMBER.finditer(rest):
        if not doc.has_number(m.group(0)):
            flagged.add(m.group(0))
    for run in _name_runs(_without_headings(rest)):
        name = " ".join(run)
        if name.lower() in doc.lowered:
            continue
        if not all(doc.has_word(w) for w in run):
            flagged.add(name)
    return sorted(flagged)


# -- output checks: summaries a user would throw away --------------------------------------------------
# Measured on every output where it is recorded (the measures are stored with the item; config's `checks`
# thresholds turn them into flags, so a threshold can change without generating anything again).
_SHINGLE = 6  # words: a verbatim run this long is copied text, not a paraphrase


def compression_ratio(summary: str) -> float:
    """zlib-compressed bytes / raw bytes of the output, or of its second half if that is lower: a repetition
    loop (a word, a sub-word piece or a sentence over and over) compresses to a small fraction, and one that
    starts mid-way runs to the end (into max_tokens); prose does not (about 0.4-0.8 at summary length)."""

    def ratio(text: str) -> float:
        raw = text.encode()
        return len(zlib.compress(raw, 9)) / len(raw) if raw else 1.0

    return min(ratio(summary), ratio(summary[len(summary) // 2 :]))


def copied_share(summary: str, document: str | _Document) -> float:
    """Share of the output's 6-word runs found verbatim in its document (1.0: every one, a copy of the text)."""
    words = _DOC_TOKEN.findall(summary.lower())
    runs = {" ".join(words[i : i + _SHINGLE]) for i in range(len(words) - _SHINGLE + 1)}
    if not runs:
        return 0.0
    doc = _Document.of(document)
    # A substring search in the document's words (C speed), not a set of all its runs built per output.
    return sum(f" {run} " in doc.runs for run in runs) / len(runs)


# Words that say what a text is, not what it is about: a summary's framing, never its topic.
_FRAMING = set(
    """
summary summarise summarize summarised summarized detailed details detail information overview report
reports article content contents discussion describe described describing explain explained explaining
provide provided providing include included including cover covered covering outline outlined
highlight highlights highlighted focus focuses focused present presents presented aims various several
important different specific related based following given well also like make makes made help helps plus
""".split()
)
# Words of scripts that separate words with spaces (Latin, Greek, Cyrillic): a text in another script (Chinese,
# Japanese, Thai) has no topic words here, so the check does not judge it rather than judge it wrong.
_LETTERS = re.compile(r"[A-Za-z\u00C0-\u024F\u0370-\u03FF\u0400-\u04FF]{4,}")
_STEM = 6  # letters kept of a stemmed word


@lru_cache(maxsize=1 << 16)  # pure, and a corpus repeats its words: measured 4.2M calls per 20k outputs
def _stem(word: str) -> str:
    """A lemma without a lemmatiser: an ending off ("stepping", "steps" -> "step", "debugger" -> "debug"),
    then the first 6 letters ("compression" -> "compre"), so that a form of a document's word counts as it."""
    for ending in ("ing", "ers", "ed", "er", "es", "s"):
        if word.endswith(ending) and len(word) - len(ending) >= 4:
            word = word[: -len(ending)]
            if word[-1] == word[-2] and word[-1] not in "aeiouls":  # stepp -> step, but fall, pass
                word = word[:-1]
            break
    return word[:_STEM]


def topic_words(text: str) -> set[str]:
    """A text's topic words: content words of 4 letters or more, neither common nor framing, stemmed."""
    return {_stem(w) for w in set(_LETTERS.findall(text.lower())) - _COMMON - _FRAMING}


def topic_overlap(summary: str, document: str | _Document) -> float:
    """Share of the summary's topic words that its document holds too (1.0 when it has none: nothing to
    be off). A summary of the document talks about the document's things; one that invents a topic ("a
    report on renewable energy" for a licence text) shares almost none of them."""
    words = topic_words(summary)
    if not words:
        return 1.0
    doc = _Document.of(document)
    return len(words & doc.topic_words) / len(words)


_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_SAID_AGAIN = 0.8  # share of a sentence's word 4-grams found in an earlier sentence: the sentence said again
_CLAUSE, _CLAUSE_LOWER = 5, 3  # a clause said again: 5 words, 3 of them lowercase (not a name)


def _grams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


@lru_cache(maxsize=1 << 12)  # pure; calibration reads it once per threshold tried
def _clause_said_again(summary: str) -> bool:
    """A run of `_CLAUSE` words, most of them lowercase, that occurs twice ("to determine the size of the
    module"); a name said twice ("the GNU General Public License") is no repeat."""
    words, seen = _DOC_TOKEN.findall(summary), set()
    for i in range(len(words) - _CLAUSE + 1):
        run = words[i : i + _CLAUSE]
        if sum(not w[:1].isupper() for w in run) < _CLAUSE_LOWER:
            continue
        key = tuple(w.lower() for w in run)
        if key in seen:
            return True
        seen.add(key)
    return False


# A piece of a word (one or two runs of letters, each with its separator) said three times over inside one token:
# "AUTH_PAM_AUTH_PAM_AUTH_PAM_", a token loop within a word that word n-grams see as one word.
# Runs bounded to 16 letters: unbounded, the backtracking is cubic in a long run (a 1,000-letter one took 37 s).
_WORD_LOOP = re.compile(r"([A-Za-z]{2,16}[_\-.]?(?:[A-Za-z]{2,16}[_\-.]?)?)\1{2,}")


def repetition(summary: str) -> float:
    """How much of the output repeats itself: the share of its word 3-grams (or 4-grams, the higher) that
    repeat an earlier one; 1.0 when a sentence of 4 words or more is said again (80% of its 4-grams in one
    earlier sentence), a clause of 5 words is (`_clause_said_again`) or a piece of a word is, three times over
    within it (`_WORD_LOOP`). Unlike `compression_ratio` it needs
    no room for many repeats: SmolLM2's "The command is available in beta. The command is available in
    beta." within 96 tokens measures 1.0."""
    words = _DOC_TOKEN.findall(summary.lower())
    shares = [1 - len(set(g)) / len(g) for g in (_grams(words, 3), _grams(words, 4)) if g]
    earlier: list[set] = []
    for sentence in _SENTENCE.split(summary):
        grams = _grams(_DOC_TOKEN.findall(sentence.lower()), 4)
        if grams and any(sum(g in e for g in grams) >= _SAID_AGAIN * len(grams) for e in earlier):
            return 1.0
        earlier.append(set(grams))
    if _clause_said_again(summary) or _WORD_LOOP.search(summary):
        return 1.0
    return round(max(shares, default=0.0), 4)


# What an instruction to summarise says ("Summarize the following document in a few sentences."): an output
# that says it gives the prompt back instead of answering it.
_ECHO = re.compile(
    r"(?i)\b(?:summari[sz]es?|write\s+an?\s+(?:[\w-]+\s+){0,2}summary\s+of)\s+(?:the|this)\s+"
    r"(?:following\s+)?(?:document|text)s?\b(?:\s+in\s+a\s+few\s+sentences)?"
    r"|\bin\s+a\s+few\s+sentences\b|\bfaithfully\s+and\s+briefly\b"  # the default prompt's own words
    # A prompt's form said back as the answer's: "a two-sentence summary", "in a numbered format", "Here is a
    # summary of the text:", "a summary of the following command:" (measured on the labels' calibration half).
    r"|\b(?:two|three|four|five|few|\d+)[- ]sentences?\s+summary\b|\bin\s+a\s+numbered\s+format\b"
    r"|\b(?:here(?:'s|’s|\s+is)|the\s+following\s+is)\s+a\s+(?:\w+\s+)?summary\b"
    r"|\bsummary\s+of\s+the\s+following\s+(?:command|document|text)s?\b"
)


def prompt_echo(summary: str) -> float:
    """Share of the output's characters that are an instruction to summarise (0.0: none)."""
    text = summary.strip()
    return round(sum(len(m.group(0)) for m in _ECHO.finditer(text)) / len(text), 4) if text else 0.0


# Lines that are the document's markup given back, not prose: a code block (its fences and what is between
# them), a heading or its underline, a bracketed line, a command-line flag alone, a label alone ("Summary:") or
# a label whose value is no sentence ("Files: BUILDING.md CMakeLists.txt", "Copyright: 2013-2022, ...").
_FENCE = re.compile(r"^\s*(?:```|~~~)")
_MARKUP_LINE = re.compile(
    r"^\s*(?:[=\-_*#~]{3,}\s*$"
    r"|#{1,6}\s"
    r"|\[[^\]]*\]\s*$"
    r"|--?[A-Za-z][\w-]*(?:[= ]\S+)?\s*$"
    r"|[\w .-]{1,30}:\s*$"
    r"|[A-Z][\w -]{0,30}:\s+(?![^.!?]*[a-z]{3,}[^.!?]*[.!?]\s*$)\S.*$)"
)


def markup_share(summary: str) -> float:
    """Share of the output's characters on markup lines (`_MARKUP_LINE`, or inside a code block): 0.0 for prose,
    high for "This document is a summary of the following command:" and a fenced command, or a file list.
    Bullets are not counted: a list of the document's points is a summary."""
    text = summary.strip()
    if not text:
        return 0.0
    marked, fenced = 0, False
    for line in text.split("\n"):
        if _FENCE.match(line):
            marked, fenced = marked + len(line) + 1, not fenced
        elif fenced or _MARKUP_LINE.match(line):
            marked += len(line) + 1
    return round(min(1.0, marked / (len(text) + 1)), 4)


# A sentence's end: its mark, closing quotes or brackets, then a space or the end. Not after an abbreviation,
# a single letter or a list's number ("e.g.", "J. Smith", "1." of a list); "2.0" has no space after its point.
_SENTENCE_END = re.compile(r"[.!?][\"'’”)\]]*(?=\s|$)")
_NOT_AN_END = re.compile(r"(?i)(?:\b(?:e\.g|i\.e|etc|vs|cf|mr|mrs|ms|dr|no|fig|st)|\b[^\W\d]|(?:^|\s)\d{1,2})\.$")


def complete_sentences(text: str) -> str:
    """`text` up to the end of its last complete sentence: what a cut output (finish reason `length`) is
    served as, so that no summary stops mid-word. Unchanged when it holds no sentence end."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text) if not _NOT_AN_END.search(text[: m.start() + 1])]
    return text[: ends[-1]] if ends else text


# The output checks, in the order they are reported, and the item field each is measured by (stored with
# the item; null on an item recorded before the check existed, which then neither fails nor passes it).
MEASURES = {"degenerate": "compression_ratio", "copied": "copied_share", "off_topic": "topic_overlap"}
CHECKS = tuple(MEASURES)
# Measured from the summary alone where a check is applied, so never stored: an item of any age has them.
SUMMARY_MEASURES = {"repetition": repetition, "prompt_echo": prompt_echo, "markup_share": markup_share}


def measure(summary: str, document: str) -> dict:
    """What the output checks read, measured once where an output meets the text it summarises (the item's
    fields: stored and cached with it). The document is read once for all of them, each part on first use."""
    doc = _Document(document)
    return {
        "unfaithful_terms": len(unfaithful_terms(summary, doc)),
        "compression_ratio": compression_ratio(summary),
        "copied_share": copied_share(summary, doc),
        "topic_overlap": topic_overlap(summary, doc),
    }


def failed_checks(item: dict, checks) -> list[str]:
    """Names of the output checks `item` fails (`checks`: config.ChecksConfig): `degenerate` (a loop, or a
    sentence said again), `copied` (its document, or most of it, or the prompt given back; not an extract that
    states `checks.extract_min_words` of its document's topic words, when set) and `off_topic`
    (about something else). An item recorded before a check's stored measure existed does not fail it."""
    summary, failed = item.get("summary") or "", []
    ratio, share, overlap = item.get("compression_ratio"), item.get("copied_share"), item.get("topic_overlap")
    looped = len(summary) >= checks.min_chars and ratio is not None and ratio < checks.degenerate_below
    if ratio is not None and (looped or repetition(summary) > checks.repetition_above):
        failed.append("degenerate")
    copied = share is not None and len(summary.split()) >= checks.min_words and share > checks.copied_above
    if copied and checks.extract_min_words is not None:  # the document's key sentences: an extract a reader keeps
        copied = (content_words(summary, overlap) or 0) < checks.extract_min_words
    if share is not None and (copied or prompt_echo(summary) > checks.prompt_echo_above):
        failed.append("copied")
    if overlap is not None and len(topic_words(summary)) >= checks.min_topic_words and overlap < checks.off_topic_below:
        failed.append("off_topic")
    return failed


def unsupported_words(summary: str, overlap: float | None) -> int | None:
    """How many of the output's topic words its document lacks in every form (from its stored `topic_overlap`):
    content the document does not support beyond numbers and names ("refunds" in a licence without any)."""
    if overlap is None:
        return None
    words = len(topic_words(summary))
    return words - round(overlap * words)


def unsupported_share(summary: str, overlap: float | None) -> float | None:
    """The share of the output's topic words its document lacks in every form (0.0 with none): unlike their
    count (`unsupported_words`), it does not grow with the output's length."""
    if overlap is None:
        return None
    words = len(topic_words(summary))
    return round(unsupported_words(summary, overlap) / words, 4) if words else 0.0


def content_words(summary: str, overlap: float | None) -> int | None:
    """How many of its document's topic words the output states (from its stored `topic_overlap`): few for
    "The document is a summary of the setterm command.", which names its topic and says nothing of it."""
    if overlap is None:
        return None
    return round(overlap * len(topic_words(summary)))


def ends_mid_sentence(summary: str) -> bool:
    """The output's text does not end where a sentence ends: a cut output with no sentence to trim to."""
    text = summary.rstrip()
    return bool(text) and complete_sentences(text) == text and not _SENTENCE_END.search(text[-3:] + " ")


def flags(item: dict, checks) -> dict[str, bool | None]:
    """Every flag of a stored item, as the ledger and `tokenmill checks score` give them: each output check
    (null: its measure was not stored), `unfaithful` (with `checks.unsupported_above`), `vague` (fewer than
    `checks.vague_below` of its document's topic words), `truncated` (cut by `max_tokens` and still ending
    mid-sentence: `complete_sentences` found nothing to trim to), `markup` (more than `checks.markup_above` of it
    markup lines: a code block, headings, a file list given back) and `empty`."""
    summary, overlap, terms = item.get("summary") or "", item.get("topic_overlap"), item.get("unfaithful_terms")
    failed = failed_checks(item, checks)
    out: dict[str, bool | None] = {c: None if item.get(m) is None else c in failed for c, m in MEASURES.items()}
    unsupported, stated = unsupported_words(summary, overlap), content_words(summary, overlap)
    limit, share_limit, share = (
        checks.unsupported_above,
        checks.unsupported_share_above,
        unsupported_share(summary, overlap),
    )
    out["unfaithful"] = (
        None
        if terms is None
        else terms > 0
        or (None not in (limit, unsupported) and unsupported > limit)
        or (None not in (share_limit, share) and share > share_limit)
    )
    out["vague"] = None if stated is None else bool(summary.strip()) and stated < checks.vague_below
    out["markup"] = markup_share(summary) > checks.markup_above
    out["truncated"] = item.get("finish_reason") == "length" and ends_mid_sentence(summary)
    out["empty"] = not summary.strip()
    return out


def acceptable(item_flags: dict[str, bool | None]) -> bool | None:
    """An output a user keeps: no flag raised (`flags`); null when a check was not measured."""
    return None if None in item_flags.values() else not any(item_flags.values())


def keep_rank(summary: str) -> tuple:
    """How likely a reader keeps an output that passed every check, as a sort key (higher: more likely): no
    repeated phrase, no prompt or markup given back, then the most topic words (it says the most). What the run's
    summary shows as its acceptable example: "The command is available in beta. The command is available in
    beta." passes a lenient threshold and ranks below any summary without a repeat."""
    return (
        repetition(summary) == 0.0,
        prompt_echo(summary) == 0.0,
        markup_share(summary) == 0.0,
        len(topic_words(summary)),
    )
