"""The limits of the devices tiers run on: the one table of GPU peaks (datasheets), and this machine's CPU
limits, measured by a short probe and cached under $TOKENMILL_HOME.

Both the efficiency telemetry (output/telemetry.py: MFU and MBU after a run) and the hardware prior of
the estimate (plan/hardware.py: the time a job should take before it runs) divide by these figures.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Callable
from pathlib import Path

# Dense (no sparsity) peaks from NVIDIA's datasheets: HBM bytes/s, FLOP/s per weight dtype class, memory bytes.
# "8bit" is FP8 on Hopper and Ada, INT8 on the A100 (no FP8 tensor cores); "4bit" weights run at the 16-bit rate
# (W4A16 kernels dequantise to 16 bits before the matmul). Sources:
#   H200       https://www.nvidia.com/en-us/data-center/h200/  (SXM: 4.8 TB/s, 141 GB, BF16 989 TF, FP8 1,979 TF)
#   H100-SXM   https://www.nvidia.com/en-us/data-center/h100/  (SXM: 3.35 TB/s, 80 GB, BF16 989 TF, FP8 1,979 TF)
#   H100-PCIE  https://www.nvidia.com/en-us/data-center/h100/  (PCIe: 2.0 TB/s, 80 GB, BF16 756 TF, FP8 1,513 TF)
#   A100-80GB  https://www.nvidia.com/en-us/data-center/a100/  (SXM: 2,039 GB/s, BF16 312 TF, INT8 624 TOPS)
#   L40S       https://www.nvidia.com/en-us/data-center/l40s/  (864 GB/s, 48 GB, BF16 181 TF, FP8 362 TF dense)
#   L4         https://www.nvidia.com/en-us/data-center/l4/    (300 GB/s, 24 GB, BF16 121 TF, FP8 242 TF dense)
# The datasheets print sparse figures first: the dense ones are half of those.
GPU_PEAKS = {
    "H200": {"bandwidth": 4.8e12, "flops": {"16bit": 989e12, "8bit": 1979e12}, "memory": 141e9},
    "H100-SXM": {"bandwidth": 3.35e12, "flops": {"16bit": 989e12, "8bit": 1979e12}, "memory": 80e9},
    "H100-PCIE": {"bandwidth": 2.0e12, "flops": {"16bit": 756e12, "8bit": 1513e12}, "memory": 80e9},
    "A100-80GB": {"bandwidth": 2.039e12, "flops": {"16bit": 312e12, "8bit": 624e12}, "memory": 80e9},
    "L40S": {"bandwidth": 0.864e12, "flops": {"16bit": 181e12, "8bit": 362e12}, "memory": 48e9},
    "L4": {"bandwidth": 0.3e12, "flops": {"16bit": 121e12, "8bit": 242e12}, "memory": 24e9},
}
PROBE_FILE = "hardware-probe.json"
PROBE_VERSION = 1  # a change to the probe's method measures again


def gpu_names() -> list[str]:
    return list(GPU_PEAKS)


def cpu_identity() -> str:
    """What a probe result belongs to: hostname, CPU model and usable cores (a result is this machine's only)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{socket.gethostname()}|{model}|{cores}"


def measure_cpu(seconds: float = 2.0) -> dict:
    """This CPU's limits as numpy reaches them (what vLLM's CPU kernels, also BLAS-backed, can hope for): memory
    bandwidth from a 256 MiB array copy (bytes read + written) and sum, FLOP/s from float32 matmuls, the best of a
    few repeats each, within about `seconds`."""
    import numpy as np

    deadline = time.perf_counter() + seconds / 2
    a = np.ones(32 * 2**20)  # 256 MiB of float64: far beyond any cache
    b = np.empty_like(a)
    bandwidth = 0.0
    while True:
        t = time.perf_counter()
        np.copyto(b, a)
        copy = 2 * a.nbytes / (time.perf_counter() - t)
        t = time.perf_counter()
        a.sum()
        bandwidth = max(bandwidth, copy, a.nbytes / (time.perf_counter() - t))
        if time.perf_counter() > deadline:
            break
    del a, b
    n, flops = 1024, 0.0
    x, y = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
    deadline = time.perf_counter() + seconds / 2
    while True:
        t = time.perf_counter()
        x @ y
        flops = max(flops, 2 * n**3 / (time.perf_counter() - t))
        if time.perf_counter() > deadline:
            break
    # No native 16-bit or 8-bit FMA is assumed: what the float32 matmul reaches stands for every class.
    return {"bandwidth": bandwidth, "flops": {"32bit": flops, "16bit": flops, "8bit": flops}}


def cpu_peaks(home: Path | str | None = None, probe: Callable[[], dict] | None = None) -> dict:
    """This machine's measured CPU limits (as GPU_PEAKS' entries, plus `identity` and `measured_at`), from
    `home`/hardware-probe.json when it holds this machine's result, else measured by `probe` (default
    `measure_cpu`, about 2 s) and written there. `home`: $TOKENMILL_HOME (default ./.tokenmill)."""
    from pipeline.config.env import tokenmill_home

    path = Path(home) if home is not None else tokenmill_home()
    path = path / PROBE_FILE
    key = cpu_identity()
    try:
        cached = json.loads(path.read_text())
        if cached.get("identity") == key and cached.get("version") == PROBE_VERSION:
            return cached
    except (OSError, ValueError):
        pass  # none yet, or unreadable: measure
    result = {**(probe or measure_cpu)(), "identity": key, "version": PROBE_VERSION, "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time
    return result
