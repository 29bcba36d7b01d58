"""The architecture contract, read from the source (AST), so that breaking it fails the suite.

1. Layers (docs/architecture.md): a module may import its own folder and the layers below it,
   never one above. Every import counts: module level, inside functions, under TYPE_CHECKING,
   and `importlib.import_module("pipeline....")` with a literal name.
       pipeline.cli > pipeline.serve > pipeline.evals > pipeline.dev > pipeline.job > pipeline.plan > pipeline.output
       > pipeline.generate > pipeline.route > pipeline.dedup > pipeline.ingest > pipeline.stores
       > base: pipeline.config, pipeline.schema, pipeline.keys, pipeline.errors (schema and errors import nothing of
         ours)
   The facade pipeline/__init__.py imports pipeline.config, pipeline.job and pipeline.plan only; pipeline.cli may
   use it (as the DAG does); every other module inside pipeline/ imports submodules by their full
   path, never through the facade.
2. No reach-ins: no file in pipeline/, benchmarks/, tests/ or dags/ imports a `_private` name from
   another module of ours, reads `module._private` off one of our modules, or patches one by name
   (`monkeypatch.setattr(module, "_x", ...)`, `mock.patch("pipeline.x._y")`).
3. dags/ and benchmarks/ are held to rule 2 only (they may use any public module).
4. Size: no function in pipeline/ over MAX_FUNCTION_LINES lines of code (a module is as big as its concept).
5. No import circles in pipeline/ (every import counts, as in rule 1).
6. One word, one meaning: docs/architecture.md's word list ("Words") names code that exists, and the names
   it retired appear nowhere in pipeline/ or dags/.
7. Each package's docstring names every module of its folder, and none it lacks.

Each failure names the file, the line and the rule it breaks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline"
CHECKED_TREES = ("pipeline", "benchmarks", "tests", "dags")  # for rule 2

LAYERS = (
    "pipeline.cli",
    "pipeline.serve",
    "pipeline.evals",
    "pipeline.dev",
    "pipeline.job",
    "pipeline.plan",
    "pipeline.output",
    "pipeline.generate",
    "pipeline.route",
    "pipeline.dedup",
    "pipeline.ingest",
    "pipeline.stores",
    "base",
)
CONFIG_MODULES = {
    "pipeline.config." + p.stem for p in (REPO / "pipeline" / "config").glob("*.py") if p.stem != "__init__"
}
BASE = {  # base module -> base modules it may import
    "pipeline.config": CONFIG_MODULES,  # the package's face re-exports its modules
    # a module of the config package imports its siblings directly, never the face (an import circle)
    **{m: CONFIG_MODULES - {m} for m in CONFIG_MODULES},
    "pipeline.errors": set(),
    "pipeline.keys": {"pipeline.config", "pipeline.schema"},
    "pipeline.schema": set(),
    "pipeline.status": set(),
}
FACADE = "pipeline"
FACADE_MAY_IMPORT = ("pipeline.config", "pipeline.job", "pipeline.plan")
FACADE_USER_INSIDE = "pipeline.cli"  # the one folder of pipeline/ that may use the facade (like the DAG)
MAX_FUNCTION_LINES = 80


# -- reading the source ---------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(*trees: str) -> list[Path]:
    return sorted(p for tree in trees for p in (REPO / tree).rglob("*.py") if "__pycache__" not in p.parts)


OUR_MODULES = {module_name(p) for p in python_files(*CHECKED_TREES)}


def ours(name: str) -> bool:
    return name.split(".")[0] in CHECKED_TREES


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the module imported (a submodule when `from pkg import submodule`)
    names: tuple[str, ...] = ()  # names imported from it (`from target import a, b`)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(tree: ast.AST, module: str, is_package: bool, modules: set[str] = OUR_MODULES) -> list[Import]:
    """Every import of `tree` (anywhere in it), resolved to the module it loads."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(Import(node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            plain = []
            for a in node.names:
                if f"{source}.{a.name}" in modules:  # `from pipeline.dedup import guards`: a module
                    out.append(Import(node.lineno, f"{source}.{a.name}"))
                else:
                    plain.append(a.name)
            if plain:
                out.append(Import(node.lineno, source, tuple(plain)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append(Import(node.lineno, node.args[0].value))
    return out


def parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# -- rule 1: layers -------------------------------------------------------------------------------


def layer_of(module: str) -> str | None:
    if module in BASE:
        return "base"
    return next((layer for layer in LAYERS[:-1] if module == layer or module.startswith(layer + ".")), None)


def layer_problems(module: str, is_package: bool, tree: ast.AST, where: str) -> list[str]:
    """Rule 1 for one module of pipeline/: a line per import that breaks it."""
    problems = []
    own = layer_of(module)
    for imp in imports(tree, module, is_package):
        target = imp.target
        if not (target == "pipeline" or target.startswith("pipeline.")) or target == module:
            continue
        at = f"{where}:{imp.line}: {module} imports {target}"
        if module == FACADE:
            if not any(target == p or target.startswith(p + ".") for p in FACADE_MAY_IMPORT):
                problems.append(f"{at}: the facade may import {' and '.join(FACADE_MAY_IMPORT)} only")
            continue
        if target == FACADE and own != FACADE_USER_INSIDE:
            problems.append(
                f"{at} (the facade{': ' + ', '.join(imp.names) if imp.names else ''}): "
                f"inside pipeline/ import the submodule by its full path"
            )
            continue
        if target == FACADE:
            continue  # the CLI: the facade re-exports pipeline.job and pipeline.config, both below it
        theirs = layer_of(target)
        if own is None or theirs is None:
            continue  # reported by test_every_module_has_a_layer
        if own == "base":
            if theirs != "base" or target not in BASE[module]:
                allowed = ", ".join(sorted(BASE[module])) or "nothing of ours"
                problems.append(f"{at}: base module {module} may import {allowed}")
        elif LAYERS.index(theirs) < LAYERS.index(own):
            problems.append(
                f"{at}: layer {theirs} is above {own}; a module may import its own folder and the layers below it only"
            )
    return problems


def pipeline_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p)) for p in python_files("pipeline")]


def test_every_module_has_a_layer():
    lost = [
        f"{rel(p)}: {m} is in no layer; put it in a folder of pipeline/ or add it to BASE"
        for p, m in pipeline_modules()
        if m != FACADE and layer_of(m) is None
    ]
    assert not lost, "\n".join(lost)


def test_imports_follow_the_layers():
    problems = [
        line for p, m in pipeline_modules() for line in layer_problems(m, p.name == "__init__.py", parse(p), rel(p))
    ]
    assert not problems, "layer rule broken (docs/architecture.md):\n" + "\n".join(problems)


def import_graph() -> dict[str, set[str]]:
    """pipeline/'s modules -> the modules of pipeline/ each imports (anywhere in it, TYPE_CHECKING too)."""
    modules = dict(pipeline_modules())
    known = set(modules.values())
    return {
        m: {i.target for i in imports(parse(p), m, p.name == "__init__.py") if i.target in known and i.target != m}
        for p, m in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                component.append(t)
                if t == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_import_circles():
    """A circle makes its modules one: none can be read, tested or moved without the others."""
    found = circles(import_graph())
    assert not found, "import circles in pipeline/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_architecture_doc_names_only_modules_that_exist():
    """docs/architecture.md maps the code: a module it names that was moved or deleted makes it false."""
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = set(re.findall(r"`([\w/]+\.py)`", doc))
    ours = {rel(p) for p in python_files("pipeline", "tests")}
    missing = sorted(
        n
        for n in names
        if not (n in ours or f"pipeline/{n}" in ours or ("/" not in n and any(o.endswith("/" + n) for o in ours)))
    )
    assert not missing, "docs/architecture.md names modules that do not exist: " + ", ".join(missing)


def defined_names(path: Path) -> set[str]:
    """What a module defines: its functions, classes and assigned names, and `Class.member` for members."""
    names = set()
    for node in parse(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    names.add(f"{node.name}.{member.target.id}")
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def who_does_what_problems(doc: str, defined: dict[str, set[str]]) -> list[str]:
    """Each row of the doc's "Who does what" table: the names of its first column are defined in the files of
    its second (a name moved to another module, renamed or deleted makes the row false)."""
    table = doc.split("## Who does what", 1)[1].split("\n## ", 1)[0]
    problems = []
    for row in table.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or not cells[2].strip().startswith("`"):
            continue
        files = [f if f in defined else f"pipeline/{f}" for f in re.findall(r"`([\w/]+\.py)`", cells[2])]
        have = set().union(*(defined.get(f, set()) for f in files))
        have |= {f"{Path(f).stem}.{n}" for f in files for n in defined.get(f, set())}  # `faults.inject`
        problems += [
            f"docs/architecture.md, Who does what: `{name}` is not defined in {', '.join(files)}"
            for name in re.findall(r"`([\w.]+)`", cells[1])
            if name not in have
        ]
    return problems


def test_who_does_what_names_code_where_it_is():
    """The table of collaborators is a map of the code: each name in the file the row gives."""
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    defined = {rel(p): defined_names(p) for p in python_files("pipeline")}
    problems = who_does_what_problems(doc, defined)
    assert not problems, "\n".join(problems)


def test_who_does_what_check_catches():
    doc = "## Who does what\n| a | b | c |\n|---|---|---|\n| `gone`, `Kept.run` | `job/x.py` | r |\n## Next\n"
    defined = {"pipeline/job/x.py": {"Kept", "Kept.run"}}
    assert who_does_what_problems(doc, defined) == [
        "docs/architecture.md, Who does what: `gone` is not defined in pipeline/job/x.py"
    ]


# -- rule 2: no reach-ins -------------------------------------------------------------------------


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


_PATCHERS = {"setattr", "getattr", "delattr", "hasattr", "object"}  # builtins, monkeypatch, mock.patch.object
_DOTTED_PRIVATE = re.compile(r"^(?:%s)(?:\.\w+)*\._(?!_)\w*(?:\.\w+)*$" % "|".join(CHECKED_TREES))


def _dotted(node: ast.AST) -> list[str] | None:
    """['a', 'b', 'c'] for the expression a.b.c, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _module_bindings(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Names this file binds to one of our modules (anywhere in the file) -> that module."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if ours(a.name):  # `import a.b as x` binds x to a.b; `import a.b` binds a to a
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for a in node.names:
                if f"{source}.{a.name}" in OUR_MODULES:
                    bound[a.asname or a.name] = f"{source}.{a.name}"
    return bound


def _resolve(chain: list[str], bound: dict[str, str]) -> tuple[str, list[str]] | None:
    """(our module the chain's prefix names, the attributes after it), or None."""
    if chain[0] not in bound:
        return None
    module, rest = bound[chain[0]], chain[1:]
    while rest and f"{module}.{rest[0]}" in OUR_MODULES:
        module, rest = f"{module}.{rest[0]}", rest[1:]
    return module, rest


def reach_in_problems(module: str, is_package: bool, tree: ast.AST, where: str) -> list[str]:
    """Rule 2 for one file: a line per private name taken from another module of ours."""
    problems = []
    for imp in imports(tree, module, is_package):
        if ours(imp.target) and imp.target != module:
            for name in imp.names:
                if private(name):
                    problems.append(
                        f"{where}:{imp.line}: imports private {name} from {imp.target}; use (or add) a public name"
                    )
            if private(imp.target.rsplit(".", 1)[-1]) and not imp.names:
                problems.append(f"{where}:{imp.line}: imports private module {imp.target}")
    bound = _module_bindings(tree, module, is_package)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            chain = _dotted(node)
            found = chain and _resolve(chain[:-1], bound)
            if found and not found[1] and found[0] != module:
                problems.append(
                    f"{where}:{node.lineno}: reads {'.'.join(chain)}, private to {found[0]}; use (or add) a public name"
                )
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            args = node.args
            if (
                name in _PATCHERS
                and len(args) >= 2
                and isinstance(args[1], ast.Constant)
                and isinstance(args[1].value, str)
                and private(args[1].value)
            ):
                chain = _dotted(args[0])
                found = chain and _resolve(chain, bound)
                if found and not found[1] and found[0] != module:
                    problems.append(
                        f"{where}:{node.lineno}: {name}() on {found[0]}.{args[1].value}, a private "
                        f"name; tests inject faults through documented seams"
                    )
            for arg in args[:1]:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and _DOTTED_PRIVATE.match(arg.value)
                    and name in ("setattr", "patch", "delattr")
                ):
                    problems.append(f"{where}:{node.lineno}: {name}({arg.value!r}) patches a private name")
    return problems


def test_no_reach_ins():
    problems = [
        line
        for p in python_files(*CHECKED_TREES)
        for line in reach_in_problems(module_name(p), p.name == "__init__.py", parse(p), rel(p))
    ]
    assert not problems, "private name used from another module:\n" + "\n".join(problems)


# -- rule 4: size ---------------------------------------------------------------------------------


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    """The function's lines that hold code: not blank, not a comment alone, not its docstring (`ruff format`
    lays a long call out one argument per line; those lines count, as they are read)."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i in lines if source[i - 1].strip() and not source[i - 1].lstrip().startswith("#"))


def size_problems(tree: ast.AST, where: str, source: list[str]) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines of code. A module has no cap: it is as big as its concept."""
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = code_lines(node, source)
            if n > MAX_FUNCTION_LINES:
                over = f"is {n} lines of code, over {MAX_FUNCTION_LINES}"
                problems.append(f"{where}:{node.lineno}: function {node.name} {over}: split it")
    return problems


def test_functions_are_small():
    problems = [
        line for p in python_files("pipeline") for line in size_problems(parse(p), rel(p), p.read_text().split("\n"))
    ]
    assert not problems, "too big to read in one sitting:\n" + "\n".join(problems)


# -- the checks themselves catch what they should -------------------------------------------------


def _layer(source: str, module: str, is_package: bool = False) -> list[str]:
    return layer_problems(module, is_package, ast.parse(source), "x.py")


def _reach(source: str, module: str = "tests.test_x") -> list[str]:
    return reach_in_problems(module, False, ast.parse(source), "x.py")


@pytest.mark.parametrize(
    "source, module, broken",
    [
        ("from pipeline.generate.requests import build_requests", "pipeline.dedup.cluster", True),
        ("def f():\n    from pipeline.job import estimate", "pipeline.output.report", True),
        ("import pipeline.cli", "pipeline.dev.samples", True),
        ("from ..generate import engine", "pipeline.dedup.cluster", True),
        ("from pipeline import load_config", "pipeline.job.orchestrate", True),
        ("from pipeline import load_config", "pipeline.cli.common", False),
        ("from pipeline.stores import storage", "pipeline", True),
        ("from pipeline.config import TokenmillConfig", "pipeline.schema", True),
        ("import importlib\nimportlib.import_module('pipeline.job.lifecycle')", "pipeline.stores.cache", True),
        (
            "from pipeline.keys import add_item_keys\nfrom pipeline.stores import storage",
            "pipeline.dedup.cluster",
            False,
        ),
        ("from pipeline.dedup import guards", "pipeline.dedup.cluster", False),
        ("from . import minhash", "pipeline.dedup.cluster", False),
        ("from pipeline.config import TokenmillConfig", "pipeline.keys", False),
        ("from pipeline.job.lifecycle import Job", "pipeline", False),
    ],
)
def test_layer_check_catches(source, module, broken):
    assert bool(_layer(source, module, is_package=module == "pipeline")) == broken


@pytest.mark.parametrize(
    "source, broken",
    [
        ("from pipeline.job.lifecycle import _Job", True),
        ("import pipeline.generate.engine as infer\ninfer._ENGINES.clear()", True),
        ("from pipeline.generate import engine\nfor e in engine._ENGINES.values(): pass", True),
        ("import pipeline.generate.engine\npipeline.generate.engine._ENGINES", True),
        ("from pipeline.job import lifecycle\ndef t(monkeypatch):\n    monkeypatch.setattr(lifecycle, '_x', 1)", True),
        ("def t(monkeypatch):\n    monkeypatch.setattr('pipeline.job.lifecycle._x', 1)", True),
        ("from pipeline.generate import engine\nengine.EnginePool.__name__\nengine.__file__", False),
        ("from pipeline.generate.engine import EnginePool\nEnginePool._private_to_class", False),
        ("import os\nos._exit", False),
    ],
)
def test_reach_in_check_catches(source, broken):
    assert bool(_reach(source)) == broken


def test_circle_check_catches():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_size_check_catches():
    body = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert size_problems(ast.parse(body), "x.py", body.splitlines()) == [
        f"x.py:1: function f is {MAX_FUNCTION_LINES + 1} lines of code, over {MAX_FUNCTION_LINES}: split it"
    ]
    # Its docstring, comments and blank lines are not code: the same function with them fits.
    fits = 'def f():\n    """Doc\n    string."""\n' + "    # why\n\n" * 40 + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    assert size_problems(ast.parse(fits), "x.py", fits.splitlines()) == []


# -- rule 6: one word, one meaning ------------------------------------------------------------------
VOCABULARY_TREES = ("pipeline", "dags")  # the code the glossary speaks for (old migrations keep old names)


def glossary() -> dict[str, str]:
    """docs/architecture.md's word list (its `## Words` section): bold word -> its entry's text."""
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    entries = re.findall(r"^- \*\*(.+?)\*\*(.*?)(?=^- \*\*|\Z)", section, flags=re.M | re.S)
    return {word: " ".join(text.split()) for word, text in entries}


def listed(entry: str, label: str) -> list[str]:
    """The backticked names after `Names:` or `Not:` in an entry, up to the next full stop."""
    found = re.search(rf"\b{label}: (.*?)(?:\.(?:\s|$)|$)", entry)
    return re.findall(r"`([^`]+)`", found.group(1)) if found else []


def words_of(identifier: str) -> tuple[str, ...]:
    """An identifier's words, lower case: `claim_staging` and `ClaimStaging` are both (claim, staging)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", identifier)
    return tuple(w.lower() for w in spaced.split("_") if w)


def code_names(trees=VOCABULARY_TREES) -> tuple[dict[str, str], dict[str, str]]:
    """(every identifier the code defines or uses -> where first, every string literal -> where first) in
    `trees`, old migrations left out (they keep the names they renamed)."""
    names: dict[str, str] = {}
    strings: dict[str, str] = {}
    for path in python_files(*trees):
        if "migrations/versions" in rel(path):
            continue
        names.setdefault(path.stem, rel(path))
        for node in ast.walk(parse(path)):
            where = f"{rel(path)}:{getattr(node, 'lineno', 0)}"
            found = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(node.name)
            elif isinstance(node, ast.Name):
                found.append(node.id)
            elif isinstance(node, ast.Attribute):
                found.append(node.attr)
            elif isinstance(node, ast.arg):
                found.append(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                found.append(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.setdefault(node.value, where)
            for name in found:
                names.setdefault(name, where)
    return names, strings


def vocabulary_problems(words: dict[str, str], names: dict[str, str], strings: dict[str, str]) -> list[str]:
    problems = []
    for word, entry in words.items():
        if not entry.strip(" :(").strip():
            problems.append(f"docs/architecture.md: the word {word!r} has no meaning [rule 6]")
        for name in listed(entry, "Names"):
            if name not in names and name not in strings:
                problems.append(f"docs/architecture.md: {word!r} names `{name}`, which the code does not have [rule 6]")
        for old in listed(entry, "Not"):
            retired = words_of(old)
            for name, where in names.items():
                have = words_of(name)
                if any(have[i : i + len(retired)] == retired for i in range(len(have) - len(retired) + 1)):
                    problems.append(f"{where}: `{name}` says {old!r}, which {word!r} replaced [rule 6]")
            if old in strings:
                problems.append(f"{strings[old]}: the string {old!r}, which {word!r} replaced [rule 6]")
    return problems


def test_the_glossary_and_the_code_use_one_word_per_meaning():
    """Each word of docs/architecture.md's list means one thing: the names it lists exist, and the names it
    retired appear nowhere in pipeline/ or dags/ (as a name, part of one, or a string such as a status)."""
    words = glossary()
    assert {"planning", "staging", "stage", "part", "context", "state"} <= set(words)
    problems = vocabulary_problems(words, *code_names())
    assert not problems, "\n".join(problems)


def test_vocabulary_check_catches():
    words = {"planning": "the phase. Names: `claim_planning`. Not: `claim_staging`, `planner`."}
    names = {"claim_planning": "a.py:1", "WavePlanner": "b.py:2", "claim_staging_now": "c.py:3"}
    problems = vocabulary_problems(words, names, {"planner": "d.py:4"})
    assert len(problems) == 3 and all("rule 6" in p for p in problems)
    assert vocabulary_problems({"x": "x. Names: `gone`."}, {}, {})[0].endswith("does not have [rule 6]")
    assert words_of("WavePlanner") == ("wave", "planner") and words_of("claim_staging") == ("claim", "staging")


# -- rule 7: each package's docstring lists its modules ---------------------------------------------
def package_docstring_problems(folder: Path) -> list[str]:
    """A package's `__init__.py` says what it holds: every module of the folder named there (`name.py`, or
    `name/` for a subpackage), and no module named there that the folder lacks."""
    init = folder / "__init__.py"
    doc = ast.get_docstring(parse(init)) or ""
    modules = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    modules |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").exists() or p.name == "migrations"}
    named = set(re.findall(r"(?<![\w/.])(\w+\.py|\w+/)(?![\w])", doc))
    files = {n for n in named if n.endswith(".py")}
    named |= {f"{m}.py" for m in re.findall(r"`(\w+)`", doc)}  # config's style: a module as `name`
    problems = [f"{rel(init)}: its docstring does not name {m} [rule 7]" for m in sorted(modules - named)]
    problems += [
        f"{rel(init)}: its docstring names {m}, not in the folder [rule 7]"
        for m in sorted(n for n in files if n not in modules)
    ]
    return problems


def test_package_docstrings_name_their_modules():
    """Each folder's `__init__.py` says what it holds (docs/architecture.md, "Folders"): a module added or
    moved without a line there makes it false."""
    folders = [i.parent for i in sorted(PACKAGE.glob("*/__init__.py"))]
    problems = [p for folder in folders for p in package_docstring_problems(folder)]
    assert not problems, "\n".join(problems)
