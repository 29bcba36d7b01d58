"""One contract, two stores: the embedded SQLite store and a real Redis (started on a free port)."""

import logging
import time

import numpy as np
import pytest

from pipeline.config import CacheConfig
from pipeline.dedup.index import load_index, pack_segment
from pipeline.stores.cache import LocalStore, RedisStore, ResilientStore, open_store

VALUE = {
    "summary": "s",
    "tier": "small",
    "model": "m",
    "prompt_tokens": 3,
    "cached_prompt_tokens": 0,
    "output_tokens": 2,
    "finish_reason": "stop",
    "id": "a",
    "job_id": "j1",
    "cost_usd": 0.25,
    "baseline_gpu_seconds": 1.5,
}


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
    # The server stops answering for a minute (far longer than any load delays the store); the test's end stops it.
    redis_server.client().client_pause(60_000)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        assert store.get_many("s", ["k"]) == {}
    assert store.bypassed and time.perf_counter() - started < 30 and "Timeout" in caplog.text


TENANTS = ["acme", "acme:x", "*", "acm", "acme*", "[a]cme", "shared"]


def fill(store, scopes):
    for scope in scopes:
        store.put_many(scope, {"k1": {**VALUE, "id": scope}, "k2": VALUE})
        store.put_segment(scope, "r1@3", "job1/p0", scope.encode())
        store.put_segment(scope, "r2@3", "job1/p0", b"x")


def test_forget_removes_exactly_one_tenants_entries_and_segments(make_store):
    from pipeline.keys import tenant_scope

    store = make_store()
    scopes = [tenant_scope(t, set()) for t in TENANTS] + ["shared"]
    fill(store, scopes)
    assert store.forget(tenant_scope("acme", set())) == {"entries": 2, "segments": 2}
    assert store.get_many("t=acme", ["k1", "k2"]) == {} and store.segments("t=acme", "r1@3") == {}
    for scope in scopes[1:]:  # `acme:x`, `*`, `acme*`: each a glob or a prefix that matched `acme` before
        assert store.get_many(scope, ["k1"])["k1"]["id"] == scope
        assert store.segments(scope, "r1@3") == {"job1/p0": scope.encode()}
    assert store.forget("t=*") == {"entries": 2, "segments": 2}
    assert store.get_many("t=acme:x", ["k1"]) and store.get_many("t=acm", ["k1"]) and store.get_many("shared", ["k1"])
    assert store.forget("t=*") == {"entries": 0, "segments": 0}, "forgetting twice removes nothing more"


def test_redis_keys_of_a_tenant_never_share_a_prefix_with_another_tenants(redis_server):
    store = RedisStore(redis_server.url, "tokenmill")
    fill(store, ["t=acme", "t=acme:x", "t=*"])
    keys = sorted(k.decode() for k in redis_server.client().keys("*"))
    mine = [k for k in keys if k.startswith("tokenmill:t=acme:")]
    assert len(mine) == 4 and len(keys) == 12, keys  # 2 values + 2 index hashes per tenant
    # The documented redis-cli pattern is exact too: a tenant's scope never contains `:` or a glob character.
    assert sorted(k.decode() for k in redis_server.client().keys("tokenmill:t=acme:*")) == mine


def test_cache_forget_command(make_store, request, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.conftest import TINY_CONFIG

    store = make_store()
    fill(store, ["t=acme", "t=acme:x", "t=*"])
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    if isinstance(store, LocalStore):
        monkeypatch.setenv("TOKENMILL_CACHE__PATH", str(tmp_path / "cache"))
    else:
        monkeypatch.setenv("TOKENMILL_CACHE__STORE", "redis")
        monkeypatch.setenv("TOKENMILL_CACHE__REDIS_URL", request.getfixturevalue("redis_server").url)
        monkeypatch.setenv("TOKENMILL_CACHE__NAMESPACE", "tm-test")
    result = CliRunner().invoke(app, ["cache", "forget", "--config", str(TINY_CONFIG), "--tenant", "*"])
    assert result.exit_code == 0, result.output
    assert "2 entries and 2 index segments" in result.output
    assert store.get_many("t=*", ["k1"]) == {}
    assert store.get_many("t=acme", ["k1"]) and store.get_many("t=acme:x", ["k1"])


def test_cache_forget_of_an_unreachable_store_is_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli import app
    from tests.conftest import TINY_CONFIG, free_port

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.setenv("TOKENMILL_CACHE__STORE", "redis")
    monkeypatch.setenv("TOKENMILL_CACHE__REDIS_URL", f"redis://:Xq7/Zk9@127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("TOKENMILL_CACHE__TIMEOUT_SECONDS", "0.5")
    result = CliRunner().invoke(app, ["cache", "forget", "--config", str(TINY_CONFIG), "--tenant", "acme"])
    assert result.exit_code == 2 and result.stderr.startswith("error: cache redis") and "Traceback" not in result.output
    assert "Xq7" not in result.output and "Zk9" not in result.output


def test_unreachable_redis_warning_shows_no_part_of_the_password(caplog):
    from tests.conftest import free_port
    from tests.unit.test_config import PASSWORD, assert_hidden

    for password in (PASSWORD, "Xq7/Zk9", "Xq7#Zk9", "Xq7?Zk9", "Xq7@Zk9:Wm3%Pp5"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            store = open_store(
                CacheConfig(
                    store="redis", redis_url=f"redis://:{password}@127.0.0.1:{free_port()}/0", timeout_seconds=0.5
                )
            )
        assert store.bypassed and "127.0.0.1" in caplog.text
        assert_hidden(caplog.text + store.describe)


def test_redis_password_may_hold_any_character(redis_server, caplog):
    from tests.unit.test_config import PASSWORD, assert_hidden

    redis_server.client().config_set("requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{redis_server.port}/0"
    with caplog.at_level(logging.WARNING):
        store = open_store(CacheConfig(store="redis", redis_url=url))
        assert not store.bypassed, caplog.text
        store.put_many("t=a", {"k": VALUE})
        assert store.get_many("t=a", ["k"]) == {"k": VALUE}
        assert store.describe == f"redis redis://***@127.0.0.1:{redis_server.port}/0"
        wrong = open_store(CacheConfig(store="redis", redis_url=url.replace("Tt4", "Tt5")))
    assert wrong.bypassed and "AuthenticationError" in caplog.text
    assert_hidden(caplog.text + wrong.describe)
