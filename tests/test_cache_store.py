"""One contract, two stores: the embedded SQLite store and a real Redis (started on a free port)."""

import logging
import time

import numpy as np
import pytest

from pipeline.config import CacheConfig
from pipeline.dedup.index import load_index, pack_segment
from pipeline.stores.cache import LocalStore, RedisStore, ResilientStore, open_store

VALUE = {"summary": "s", "tier": "small", "model": "m", "prompt_tokens": 3, "cached_prompt_tokens": 0,
         "output_tokens": 2, "finish_reason": "stop", "id": "a", "job_id": "j1", "cost_usd": 0.25,
         "baseline_gpu_seconds": 1.5}


@pytest.fixture(params=["local", "redis"])
def make_store(request, tmp_path):
    """A factory: make_store(ttl_seconds=None) -> a fresh store of the parametrised kind."""
    if request.param == "local":
        return lambda ttl=None: LocalStore(tmp_path / "cache", ttl)
    server = request.getfixturevalue("redis_server")
    return lambda ttl=None: RedisStore(server.url, "tm-test", ttl)


def test_values_round_trip_per_scope(make_store):
    store = make_store()
    assert store.get_many("t=a", ["k1"]) == {}
    store.put_many("t=a", {"k1": VALUE, "k2": {**VALUE, "summary": "two"}})
    assert store.get_many("t=a", ["k1", "k2", "k3"]) == {"k1": VALUE, "k2": {**VALUE, "summary": "two"}}
    assert store.get_many("t=b", ["k1"]) == {}, "a key is only found in the scope that stored it"


def test_many_keys_cross_chunk_boundaries(make_store):
    store = make_store()
    values = {f"k{i}": {**VALUE, "id": str(i)} for i in range(2_345)}
    store.put_many("s", values)
    got = store.get_many("s", [f"k{i}" for i in range(2_400)])
    assert len(got) == 2_345 and got["k2344"]["id"] == "2344"


def test_entries_expire_after_their_ttl(make_store):
    store = make_store(ttl=1)
    store.put_many("s", {"k": VALUE})
    assert "k" in store.get_many("s", ["k"])
    time.sleep(2.1)
    assert store.get_many("s", ["k"]) == {}


def test_index_segments_are_replaced_by_name_and_kept_apart_by_scope_and_recipe(make_store):
    store = make_store()
    store.put_segment("s", "r1", "job1/p0", b"one")
    store.put_segment("s", "r1", "job1/p1", b"two")
    store.put_segment("s", "r1", "job1/p0", b"three")  # the partition ran again
    store.put_segment("s", "r2", "job1/p0", b"other recipe")
    store.put_segment("t", "r1", "job1/p0", b"other scope")
    assert store.segments("s", "r1") == {"job1/p0": b"three", "job1/p1": b"two"}


def test_index_skips_a_corrupt_segment_with_a_warning(make_store, caplog):
    store = ResilientStore(make_store(), "test")
    sigs = np.arange(8, dtype=np.uint32).reshape(2, 4)
    store.put_segment("s", "r", "good", pack_segment(["k1", "k2"], ["a", "b"], sigs, None, ["[]", "[]"]))
    blob = bytearray(pack_segment(["k3"], ["c"], sigs[:1], None, ["[]"]))
    blob[-5] ^= 0xFF
    store.put_segment("s", "r", "torn", bytes(blob))
    with caplog.at_level(logging.WARNING):
        index = load_index(store, "s", "r")
    assert index["keys"].tolist() == ["k1", "k2"]
    assert "torn" in caplog.text and "unreadable" in caplog.text


def test_unreachable_redis_is_bypassed_with_one_warning(caplog):
    from tests.conftest import free_port

    config = CacheConfig(store="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0", timeout_seconds=0.5)
    with caplog.at_level(logging.WARNING):
        store = open_store(config)
        assert store.bypassed
        assert store.get_many("s", ["k"]) == {}
        store.put_many("s", {"k": VALUE})
    assert len([r for r in caplog.records if "cache" in r.getMessage()]) == 1


def test_redis_that_dies_or_fills_up_mid_job_is_bypassed(redis_server, caplog):
    config = CacheConfig(store="redis", redis_url=redis_server.url, timeout_seconds=0.5)
    store = open_store(config)
    store.put_many("s", {"k": VALUE})
    assert store.get_many("s", ["k"]) == {"k": VALUE} and not store.bypassed

    redis_server.client().config_set("maxmemory", "1")  # full: every write is refused (OOM)
    with caplog.at_level(logging.WARNING):
        store.put_many("s", {"k2": VALUE})
    assert store.bypassed and "OutOfMemoryError" in caplog.text
    assert store.get_many("s", ["k"]) == {}, "bypassed for the rest of the job: no more slow failures"

    redis_server.client().config_set("maxmemory", "0")
    store = open_store(config)
    redis_server.stop()
    assert store.get_many("s", ["k"]) == {} and store.bypassed


def test_slow_redis_is_bypassed_after_its_timeout(redis_server, caplog):
    store = open_store(CacheConfig(store="redis", redis_url=redis_server.url, timeout_seconds=0.3))
    store.put_many("s", {"k": VALUE})
    redis_server.client().client_pause(3000)  # the server stops answering for 3 s
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        assert store.get_many("s", ["k"]) == {}
    assert store.bypassed and time.perf_counter() - started < 2.5 and "Timeout" in caplog.text
