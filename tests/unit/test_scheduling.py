"""The suite's own xdist scheduling (tests/conftest.py): the engine tests keep to one worker.

tests/engine/conftest.py checks the same at run time, under xdist: a second worker running an engine
test fails it.
"""

from __future__ import annotations


def test_under_xdist_every_engine_test_goes_to_one_worker(pytestconfig, monkeypatch):
    """The suite's scheduler (tests/conftest.py) puts tests/engine/ in one scope, so one worker runs
    them all, one engine at a time; every other test is a scope of its own, free to go to either worker."""
    from tests.conftest import pytest_xdist_make_scheduler

    monkeypatch.setattr(pytestconfig.option, "tx", ["popen", "popen"], raising=False)  # as `-n 2` gives
    monkeypatch.setattr(pytestconfig.option, "dist", "load")
    scheduler = pytest_xdist_make_scheduler(pytestconfig, log=None)
    engine = {"tests/engine/test_lora.py::test_a[vllm]", "tests/engine/test_jobs.py::test_b", "tests/engine/x.py::C::d"}
    others = ["tests/unit/test_keys.py::test_a", "tests/unit/test_keys.py::test_b", "tests/system/test_faults.py::t[1]"]
    assert {scheduler._split_scope(n) for n in engine} == {"engine"}
    assert len({scheduler._split_scope(n) for n in others}) == len(others)
    assert "engine" not in {scheduler._split_scope(n) for n in others}


def test_another_distribution_asked_for_is_left_to_xdist(pytestconfig, monkeypatch):
    from tests.conftest import pytest_xdist_make_scheduler

    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile")
    assert pytest_xdist_make_scheduler(pytestconfig, log=None) is None
