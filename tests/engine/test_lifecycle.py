"""The real engine's life in a process: a script that never stops its engine still exits. (Start-up failures
are in test_fake_engine_contract.py, on both engines.)"""

import subprocess
import sys

from tests.conftest import TINY_CONFIG

EXITS_WITHOUT_SHUTDOWN = """
import sys
from pipeline.config import SamplingConfig, load_config
from pipeline.generate.engine import EnginePool
config = load_config(sys.argv[1])
pool = EnginePool(config.tiers)
pool.tokenizer("small")  # what a job loads first
(completion,) = pool.engine("small").generate([[5, 6, 7]], [4], SamplingConfig())
print("generated", completion.output_tokens)
"""


def test_process_exits_with_an_engine_still_running(tiny_models):
    """A script that never stops its engine must still exit (benchmarks do this; the CLI stops its own)."""

    r = subprocess.run(
        [sys.executable, "-c", EXITS_WITHOUT_SHUTDOWN, str(TINY_CONFIG)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TINY_CONFIG.parents[1],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "generated" in r.stdout
