"""The hardware prior's calibration check: each published throughput figure (pipeline/plan/hardware.py
CALIBRATION: MLPerf Inference, TensorRT-LLM's H200 launch figures) against the projection with the one set of
efficiency factors, the ratio and whether it is within ±30%; and this machine's CPU limits as the probe measured
them (cached under $TOKENMILL_HOME; `--measure` measures again). No engine runs.

    python benchmarks/hardware_projection.py [--measure]

Prints one JSON line (benchmarks/common.py `emit`); docs/estimate.md lists the same rows with their sources.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit  # noqa: E402
from pipeline.output.devices import PROBE_FILE, cpu_peaks  # noqa: E402
from pipeline.plan import hardware  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure this CPU again (about 2 s)")
    args = parser.parse_args(argv)
    if args.measure:
        from pipeline.config.env import tokenmill_home

        (tokenmill_home() / PROBE_FILE).unlink(missing_ok=True)
    rows = hardware.calibration_rows()
    within = [0.7 <= r["ratio"] <= 1.3 for r in rows]
    cpu = cpu_peaks()
    emit(
        "hardware_projection",
        {
            "efficiency": {"gpu": hardware.GPU_EFFICIENCY, "cpu": hardware.CPU_EFFICIENCY},
            "rows": rows,
            "within_30pct": sum(within),
            "rows_total": len(rows),
            "target_met": all(within),
            "cpu_probe": {
                "bandwidth_gb_s": round(cpu["bandwidth"] / 1e9, 2),
                "fp32_gflop_s": round(cpu["flops"]["32bit"] / 1e9, 1),
            },
        },
    )


if __name__ == "__main__":
    main()
