"""Under xdist, the engine tests run on one worker (the suite's scheduler, tests/conftest.py): two vLLM
engines at once on 2 cores would starve each other. Checked at run time, because xdist's own grouping
once failed silently: the first worker to run an engine test claims them, and any other fails."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _engine_tests_on_one_worker(request, tmp_path_factory):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    claim = tmp_path_factory.getbasetemp().parent / "engine-worker"  # shared by the session's workers
    mine = claim.with_name(f"engine-worker-{worker}")
    mine.write_text(worker)
    try:
        os.link(mine, claim)  # atomic: the first worker's name, whole, or nothing
    except FileExistsError:
        pass
    owner = claim.read_text()
    assert owner == worker, f"{request.node.nodeid} ran on {worker}, but engine tests already ran on {owner}"
