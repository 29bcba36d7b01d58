"""Build the hold-out evaluation set: real text from this machine, with labelled reuse variants.

Prints one JSON line with its counts by source kind and variant kind (see pipeline/dev/holdout.py).

    python benchmarks/eval_set.py OUT.jsonl [--documents 300] [--variants 250] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit  # noqa: E402
from pipeline.dev.holdout import build_holdout  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--variants", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    emit("eval_set", build_holdout(args.out, args.documents, args.variants, args.seed))


if __name__ == "__main__":
    main()
