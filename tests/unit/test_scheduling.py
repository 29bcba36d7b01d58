"""The suite's own xdist scheduling (tests/conftest.py): the engine tests keep to one worker, a module
with a module-scoped fixture keeps to one worker, and the longest levels go out first.

tests/engine/conftest.py checks the same at run time, under xdist: a second worker running an engine
test fails it.
"""

from __future__ import annotations

from collections import OrderedDict


def _scheduler(pytestconfig, monkeypatch):
    from tests.conftest import pytest_xdist_make_scheduler

    monkeypatch.setattr(pytestconfig.option, "tx", ["popen", "popen"], raising=False)  # as `-n 2` gives
    monkeypatch.setattr(pytestconfig.option, "dist", "load", raising=False)
    monkeypatch.setattr(pytestconfig.option, "loadscopereorder", True, raising=False)  # xdist's default
    return pytest_xdist_make_scheduler(pytestconfig, log=None)


def test_under_xdist_every_engine_test_goes_to_one_worker(pytestconfig, monkeypatch):
    """The suite's scheduler (tests/conftest.py) puts tests/engine/ in one scope, so one worker runs
    them all, one engine at a time; a module with a module-scoped fixture (test_airflow.py's migrated
    Airflow) is one scope, set up once; every other test is a scope of its own, free to go to any worker."""
    scheduler = _scheduler(pytestconfig, monkeypatch)
    engine = {"tests/engine/test_lora.py::test_a[vllm]", "tests/engine/test_jobs.py::test_b", "tests/engine/x.py::C::d"}
    others = ["tests/unit/test_keys.py::test_a", "tests/unit/test_keys.py::test_b", "tests/system/test_faults.py::t[1]"]
    assert {scheduler._split_scope(n) for n in engine} == {"tests/engine/"}
    assert len({scheduler._split_scope(n) for n in others}) == len(others)
    assert "tests/engine/" not in {scheduler._split_scope(n) for n in others}
    airflow = {scheduler._split_scope(f"tests/system/test_airflow.py::{t}") for t in ("test_a", "test_b")}
    assert airflow == {"tests/system/test_airflow.py"}
    assert not pytestconfig.option.loadscopereorder  # xdist would sort the queue by tests per scope


def test_the_longest_levels_go_out_first(pytestconfig, monkeypatch):
    scheduler = _scheduler(pytestconfig, monkeypatch)
    scopes = [
        "tests/unit/test_keys.py::test_a",
        "tests/integration/test_job.py::test_b",
        "tests/system/test_airflow.py",
        "tests/unit/test_keys.py::test_c",
        "tests/engine/",
        "tests/system/test_chaos.py::test_d",
    ]
    scheduler.workqueue = OrderedDict((scope, {}) for scope in scopes)
    scheduler.order_queue()
    assert list(scheduler.workqueue) == [
        "tests/engine/",
        "tests/system/test_airflow.py",
        "tests/system/test_chaos.py::test_d",
        "tests/integration/test_job.py::test_b",
        "tests/unit/test_keys.py::test_a",
        "tests/unit/test_keys.py::test_c",
    ]


def test_another_distribution_asked_for_is_left_to_xdist(pytestconfig, monkeypatch):
    from tests.conftest import pytest_xdist_make_scheduler

    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile", raising=False)
    assert pytest_xdist_make_scheduler(pytestconfig, log=None) is None
