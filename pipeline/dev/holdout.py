"""A hold-out set of real text that tokenmill did not write, with labelled reuse variants.

The synthetic corpus (samples.py) is what the code was tuned on, so quality measured on it flatters
the code. This set is built from text already on the machine: package READMEs and copyright files
under /usr/share/doc, the licences in /usr/share/common-licenses, Python standard-library module and
class docstrings (read from the source with ast, nothing is imported), and man pages (rendered by
groff, when it is installed). Nothing under /work or this repository is read.

Documents are whitespace-normalised (one line per paragraph, paragraphs split by a blank line) and
cut at a paragraph boundary to 1-4 KB. Exact duplicates and near-identical texts (the GPL repeated
in many copyright files) are dropped. Each source kind's candidates are visited in a seeded hash
order, the kinds taken in turn so that no kind swamps the set, and the documents written in a seeded
content-hash order: the same machine and seed give the same bytes.

Then `variants` lines pair a document with an edit of it, labelled with whether its summary SHOULD
be reused (a forwarding header, reflowed whitespace, a footer, trivial punctuation) or MUST NOT (a
number changed, a name swapped, a negation added, a different document with the same opening).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

from pipeline.dedup.guards import NUMBER
from pipeline.output.safe_text import json_line

MIN_BYTES = 1024
MAX_BYTES = 4096
DOC_MAX_BYTES = MAX_BYTES - 160  # room for a variant's header or footer within MAX_BYTES
FAMILY_CAP = 3  # documents at most per family (a man page suite like gcloud's 16,000, a stdlib package)
NEAR_OVERLAP = 0.5  # share of the smaller text's word 5-grams that makes two texts one
FORBIDDEN = (Path("/work"), Path(__file__).resolve().parents[2])  # never read: this project's own text
SOURCE_KINDS = ("readme", "copyright", "license", "stdlib", "man")
SHOULD_REUSE = ("mirror_header", "reflow", "footer", "punctuation")
MUST_NOT_REUSE = ("number_changed", "name_swapped", "negation", "same_opening")
_HEADERS = (
    "Fwd: {title}",
    "Mirrored from https://mirror.example.org/docs/{n}.txt",
    "-------- Forwarded message --------",
    "[archived copy {n}]",
)
_FOOTERS = (
    "--\nSent from the documentation mirror. To unsubscribe, mail list-request@example.org.",
    "Archived by the docs mirror, entry {n}.",
    "--\nRegards,\nThe mirror team",
)
_NAMES = (
    "Fedora",
    "Gentoo",
    "Mozilla",
    "Oracle",
    "Novell",
    "Cisco",
    "Nokia",
    "Siemens",
    "Toyota",
    "Zurich",
    "Helsinki",
    "Kyoto",
    "Lisbon",
    "Alice",
    "Bob",
    "Carol",
    "Dmitri",
    "Ingrid",
    "Rajesh",
    "Yuki",
)
_NAME_CANDIDATE = re.compile(r"(?<=[a-z,] )[A-Z][a-z]{2,}[A-Za-z]*\b")  # capitalised mid-sentence
_NOT_NAMES = {
    "Copyright",
    "License",
    "Licence",
    "Files",
    "Source",
    "Comment",
    "Format",
    "Upstream",
    "See",
    "Note",
    "The",
    "This",
    "For",
    "If",
    "When",
    "Default",
    "Options",
    "Example",
    "Examples",
    "Description",
}
_AUXILIARY = re.compile(r"\b(is|are|was|were|can|will|should|must|does|do|has|have)\b(?! not)")


def _hash(seed: int, text: str) -> str:
    return hashlib.sha256(f"{seed}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


def _allowed(path: Path) -> bool:
    real = path.resolve()
    return not any(real.is_relative_to(root) for root in FORBIDDEN)


def normalise(text: str) -> str:
    """One line per paragraph, single spaces, paragraphs split by one blank line."""
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text.replace("\r", "")))
    return "\n\n".join(p for p in paragraphs if p)


def cut(text: str) -> str | None:
    """The text's opening 1 KB to DOC_MAX_BYTES, ended at a paragraph (else a sentence) boundary."""
    out: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        sep = 2 if out else 0
        n = len(para.encode())
        if size + sep + n <= DOC_MAX_BYTES:
            out.append(para)
            size += sep + n
            continue
        if size < MIN_BYTES:  # the paragraphs so far are too short: end inside this one
            piece = para.encode()[: DOC_MAX_BYTES - size - sep].decode("utf-8", "ignore")
            end = piece.rfind(". ")
            out.append(piece[: end + 1] if end > 0 and size + end >= MIN_BYTES else piece[: piece.rfind(" ")])
        break
    doc = "\n\n".join(out).strip()
    return doc if MIN_BYTES <= len(doc.encode()) <= DOC_MAX_BYTES else None


def _prose(text: str) -> bool:
    """Mostly letters and spaces: drops tables, hex dumps and code listings."""
    return sum(c.isalpha() or c.isspace() for c in text) >= 0.8 * len(text)


def _read(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        if b"\0" in data:
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _ordered(seed: int, paths) -> list[Path]:
    """Unique real files outside the project, in a seeded order that does not depend on the listing.

    A few candidates per family only: rendering 16,000 gcloud man pages to keep three would be slow."""
    real = {}
    for p in paths:
        if p.is_file() and _allowed(p):
            real.setdefault(str(p.resolve()), p)
    per_family: Counter = Counter()
    out = []
    for p in sorted(real.values(), key=lambda p: _hash(seed, str(p))):
        per_family[family(str(p))] += 1
        if per_family[family(str(p))] <= 4 * FAMILY_CAP:
            out.append(p)
    return out


def _files(seed: int, paths):
    for path in _ordered(seed, paths):
        text = _read(path)
        if text:
            yield str(path), text


def _stdlib(seed: int):
    """Module and class docstrings of the standard library, parsed from source (nothing imported)."""
    files = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtledemo"):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if not spec or not spec.origin or not spec.origin.endswith(".py"):
            continue
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            files += [
                (f"{name}." + ".".join(p.relative_to(origin.parent).with_suffix("").parts), p)
                for p in origin.parent.rglob("*.py")
                if not {"test", "tests"} & set(p.parts)
            ]
        else:
            files.append((name, origin))
    for module, path in sorted(files, key=lambda f: _hash(seed, f[0])):
        module = module.removesuffix(".__init__")
        if not _allowed(path):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc := ast.get_docstring(tree):
            yield module, doc
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (doc := ast.get_docstring(node)):
                yield f"{module}.{node.name}", doc


def _man(seed: int):
    """English man pages of sections 1, 5, 7 and 8, rendered to plain text by groff."""
    groff = shutil.which("groff")
    if not groff:
        return
    pages = [p for s in (1, 5, 7, 8) for p in Path(f"/usr/share/man/man{s}").glob("*")]
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    for path, source in _files(seed, pages):
        if source.lstrip().startswith(".so "):
            continue  # an alias of another page
        try:
            done = subprocess.run(
                [groff, "-mandoc", "-Tutf8", "-rHY=0", "-rLL=1000n", "-P-cbou"],
                input=source,
                capture_output=True,
                text=True,
                timeout=20,
                env=env,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and len(lines) > 2:
            yield path, "\n".join(lines[1:-1])  # the page's header and footer lines dropped


def _sources(seed: int) -> dict:
    doc = Path("/usr/share/doc")
    return {
        "readme": _files(seed, doc.glob("**/README*")),
        "copyright": _files(seed, doc.glob("*/copyright")),
        "license": _files(seed, Path("/usr/share/common-licenses").glob("*")),
        "stdlib": _stdlib(seed),
        "man": _man(seed),
    }


class _NearIndex:
    """Word 5-gram sets of the kept documents, to drop a text that mostly repeats one of them."""

    def __init__(self):
        self.postings: dict[tuple, list[int]] = {}
        self.sizes: list[int] = []

    @staticmethod
    def shingles(text: str) -> set[tuple]:
        words = text.lower().split()
        return {tuple(words[i : i + 5]) for i in range(max(1, len(words) - 4))}

    def near(self, grams: set[tuple]) -> bool:
        hits = Counter(i for g in grams for i in self.postings.get(g, ()))
        return any(n >= NEAR_OVERLAP * min(len(grams), self.sizes[i]) for i, n in hits.items())

    def add(self, grams: set[tuple]) -> None:
        for g in grams:
            self.postings.setdefault(g, []).append(len(self.sizes))
        self.sizes.append(len(grams))


def family(source: str) -> str:
    """What a source is one of: a man page suite (gcloud_*), a package's docs, a stdlib package."""
    if not source.startswith("/"):
        return source.split(".")[0]
    path = Path(source)
    if path.parts[:4] == ("/", "usr", "share", "doc") and len(path.parts) > 4:
        return path.parts[4].rstrip("0123456789.") or path.parts[4]  # libgnutls30 and libgnutls-dane0 apart
    return re.split(r"[_\-.]", path.name, maxsplit=1)[0]


def collect(documents: int, seed: int = 0, sources: dict | None = None) -> list[dict]:
    """`documents` documents, the source kinds taken in turn; fewer when the sources run dry."""
    streams = dict(sources if sources is not None else _sources(seed))
    seen: set[str] = set()
    families: Counter = Counter()
    index = _NearIndex()
    picked: list[dict] = []
    while streams and len(picked) < documents:
        for kind in list(streams):
            for source, raw in streams[kind]:
                if families[(kind, family(source))] >= FAMILY_CAP:
                    continue
                text = cut(normalise(raw))
                if text is None or text in seen or not _prose(text):
                    continue
                grams = index.shingles(text)
                if index.near(grams):
                    continue
                seen.add(text)
                families[(kind, family(source))] += 1
                index.add(grams)
                picked.append({"text": text, "source": source, "kind": kind})
                break
            else:
                del streams[kind]  # this kind has no more documents
            if len(picked) >= documents:
                break
    picked.sort(key=lambda d: _hash(seed, d["text"]))
    return [{"id": f"doc-{i:04d}", **d} for i, d in enumerate(picked)]


def _paragraphs(text: str) -> list[str]:
    return text.split("\n\n")


def _edit(kind: str, doc: dict, other: dict, rng: random.Random) -> str | None:
    """The variant `kind` of `doc`'s text (`other`: a different document), or None where it cannot apply."""
    text, n = doc["text"], rng.randrange(1000, 9999)
    if kind == "mirror_header":
        title = _paragraphs(text)[0][:60].rsplit(" ", 1)[0]
        return rng.choice(_HEADERS).format(title=title, n=n) + "\n\n" + text
    if kind == "reflow":
        width = rng.randrange(48, 79)
        return "\n\n".join(textwrap.fill(p, width) for p in _paragraphs(text)) + "\n"
    if kind == "footer":
        return text + "\n\n" + rng.choice(_FOOTERS).format(n=n)
    if kind == "punctuation":
        edited = text.replace("'", "’").replace(" - ", " – ").replace('"', "”")
        if edited == text:
            edited = text.replace(", ", " ", 1) if ", " in text else text.rstrip(".") + ("." * text.endswith("."))
        return edited if edited != text else text + "."
    if kind == "number_changed":
        numbers = [m for m in NUMBER.finditer(text) if m.group(0).isdigit()]
        if not numbers:
            return None
        m = rng.choice(numbers)
        new = str(int(m.group(0)) + rng.randrange(1, 9))
        return text[: m.start()] + new + text[m.end() :]
    if kind == "name_swapped":
        lowered = set(re.findall(r"\b[a-z]+\b", text))  # a word also written in lower case is no name
        names = sorted(
            {m.group(0) for m in _NAME_CANDIDATE.finditer(text)}
            - _NOT_NAMES
            - {w for w in set(_NAME_CANDIDATE.findall(text)) if w.lower() in lowered}
        )
        fresh = [x for x in _NAMES if x.lower() not in text.lower()]
        if not names or not fresh:
            return None
        return re.sub(rf"\b{re.escape(rng.choice(names))}\b", rng.choice(fresh), text)
    if kind == "negation":
        spots = list(_AUXILIARY.finditer(text))
        if not spots:
            return None
        m = rng.choice(spots)
        word = "cannot" if m.group(1) == "can" else m.group(1) + " not"
        return text[: m.start()] + word + text[m.end() :]
    if kind == "same_opening":
        mine, theirs = _paragraphs(text), _paragraphs(other["text"])
        if len(mine) < 2 or len(theirs) < 2 or other["text"] == text:
            return None
        return cut("\n\n".join(mine[:1] + theirs[1:]))
    raise ValueError(f"unknown variant kind {kind!r}")


def make_variants(docs: list[dict], variants: int, seed: int = 0) -> list[dict]:
    """`variants` labelled edits, the kinds in turn, each on a document not yet used for that kind."""
    rng = random.Random(seed)
    kinds = [k for pair in zip(SHOULD_REUSE, MUST_NOT_REUSE) for k in pair]
    used: dict[str, set[str]] = {k: set() for k in kinds}
    out: list[dict] = []
    for slot in range(variants * 2 if docs else 0):  # a kind that fits no document leaves its slots empty
        if len(out) >= variants:
            break
        kind = kinds[slot % len(kinds)]
        for _ in range(50):
            fresh = [d for d in docs if d["id"] not in used[kind]] or docs
            doc, other = rng.choice(fresh), rng.choice(docs)
            text = _edit(kind, doc, other, rng)
            if text is not None and text != doc["text"] and MIN_BYTES <= len(text.encode()) <= MAX_BYTES:
                break
        else:
            continue
        used[kind].add(doc["id"])
        out.append(
            {
                "id": f"var-{len(out):04d}",
                "text": text,
                "variant_of": doc["id"],
                "variant": kind,
                "should_reuse": kind in SHOULD_REUSE,
            }
        )
    return out


def build_holdout(
    out: Path, documents: int = 300, variants: int = 250, seed: int = 0, *, sources: dict | None = None
) -> dict:
    """Write the hold-out set to `out` (JSONL: documents, then variants); return its counts.

    `sources` (kind -> iterable of (source, raw text)) stands in for this machine's text, for tests."""
    start = time.perf_counter()
    docs = collect(documents, seed, sources)
    edits = make_variants(docs, variants, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json_line({"id": d["id"], "text": d["text"], "source": d["source"]}))
        for v in edits:
            f.write(json_line(v))
    by_source = Counter(d["kind"] for d in docs)
    counts = {
        "out": str(out),
        "documents": len(docs),
        "by_source": dict(sorted(by_source.items())),
        "missing_sources": sorted((set(SOURCE_KINDS) | set(sources or ())) - set(by_source)),
        "variants": len(edits),
        "by_variant": dict(sorted(Counter(v["variant"] for v in edits).items())),
        "should_reuse": sum(v["should_reuse"] for v in edits),
        "must_not_reuse": sum(not v["should_reuse"] for v in edits),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if len(docs) < documents or len(edits) < variants:
        counts["note"] = (
            f"fewer than asked: {len(docs)} of {documents} documents, {len(edits)} of {variants} "
            "variants (this machine has less text in the sources)"
        )
    return counts
