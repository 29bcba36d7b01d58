"""The repository speaks only of the project: no line of tracked text tells how the work on it was organised
(its stops, work sessions, numbered issues, reviews) or names a file outside the repository. A figure carries
its date, machine and command; a test's reason is the behaviour it checks. Engine, database and test-run
sessions are the project's own words and stay (`SESSION_OF_THE_PROJECT`)."""

from __future__ import annotations

import codecs
import re
import subprocess

from tests.conftest import REPO

# Third-party text kept as published, and data whose words are a corpus's, not the project's.
NOT_OURS = ("tests/schemas/", "tests/data/", "pipeline/dev/corpora/")
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json", "Makefile", ".sql", ".j2")

REFUSED = {
    "an ordinal stop": re.compile(
        r"\b(latest|this|that|second|third|fourth|fifth|sixth|later|earlier|previous|next|same)"
        r"\s+stop(s|'s)?\b|\bstops?\s+\d+\b|\bissues\s+stops\b",
        re.IGNORECASE,
    ),
    "an ordinal session": re.compile(
        r"\b(this|an earlier|earlier|previous|another|other|later|next|between|within a)\s+sessions?('s?)?"
        r"(?!\s*(fixture|scope))\b",
        re.IGNORECASE,
    ),
    "a numbered issue": re.compile(r"\bissues?\s+#?\d+\b", re.IGNORECASE),
    "a review": re.compile(
        r"\breview(er)?s?\s+finding|\((found in )?review\)|\bfound in review\b|\bthe review\b|\breview's\b"
        r"|\breviewers?\b",
        re.IGNORECASE,
    ),
    "a file outside the repository": re.compile(r"\.\./shared\b|/work/(main|wt)\b"),
}
# Sessions of the project's own running parts: engines, databases and pytest's test runs.
SESSION_OF_THE_PROJECT = re.compile(r"\b(engine|database|db|pytest|test-run)\s+sessions?\b", re.IGNORECASE)


def tracked_text() -> list[str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [n for n in names if n.endswith(TEXT) and not n.startswith(NOT_OURS) and n != "tests/unit/test_own_words.py"]


def offending_lines() -> list[str]:
    found = []
    for name in tracked_text():
        path = REPO / name
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in REFUSED.items():
                if pattern.search(line) and not (what == "an ordinal session" and SESSION_OF_THE_PROJECT.search(line)):
                    found.append(f"{name}:{number}: {what}: {line.strip()[:160]}")
    return found


def example(encoded: str) -> str:
    """A phrase the scan must refuse, kept in ROT13 so that this file does not say it itself."""
    return codecs.decode(encoded, "rot13")


def test_tracked_text_speaks_only_of_the_project():
    found = offending_lines()
    assert not found, "\n".join(found)


def test_the_words_are_refused_in_that_sense_only():
    assert REFUSED["a numbered issue"].search(example("Ercebqhpre (vffhr 30): gur rfgvzngr cevprq n gvre"))
    assert REFUSED["an ordinal stop"].search(example("2026-12-04 (yngrfg fgbc), 2 pberf"))
    assert REFUSED["an ordinal session"].search(example("ba guvf frffvba'f 2-pber Vagry Krba"))
    assert REFUSED["a review"].search('"""Review finding: a misspelt section was ignored')
    assert REFUSED["a file outside the repository"].search("(../shared/notes/levers.md)")
    for own in (
        "the engine stops admitting work at the cap",
        "`stop` strings end the output",
        "the tier worker's engine session renews its lease",
        "stop every worker of the old version first",
        "the summary's issues are listed",
    ):
        assert not any(p.search(own) for p in REFUSED.values()), own
    assert SESSION_OF_THE_PROJECT.search("this engine session's share")
