"""The documentation's examples, as the docs test runs them (tests/integration/test_docs_examples.py).

`blocks(path)`: every ```sql, ```bash and ```python block of a Markdown file, with its line and, where the
line before its fence is `<!-- illustrative: why -->`, the reason it is not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = ("sql", "bash", "python")
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_ILLUSTRATIVE = re.compile(r"<!--\s*illustrative:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence
    language: str
    text: str
    illustrative: str | None  # the reason given, or None: the block runs

    def where(self) -> str:
        first = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return f"{self.file}:{self.line} ```{self.language} ({first[:70]})"


def blocks(path: Path, root: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        if m.group(1) not in LANGUAGES:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _ILLUSTRATIVE.search(before)
        found.append(
            Block(
                file=str(path.relative_to(root)),
                line=text.count("\n", 0, m.start()) + 1,
                language=m.group(1),
                text=m.group(2),
                illustrative=marker.group(1) if marker else None,
            )
        )
    return found
