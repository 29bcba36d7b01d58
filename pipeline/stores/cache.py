"""The reuse cache across jobs: generated outputs by content key, and the near/semantic index beside them.

One small interface (`CacheStore`), two implementations that pass the same contract tests:
  - `LocalStore`: an embedded SQLite file under `$TOKENMILL_HOME/cache` (the local default);
  - `RedisStore`: Redis in production (pipelined MGET/SET with TTL, keys prefixed per namespace and tenant scope).

Values are JSON: the output with its token counts, its origin (job, item id) and what it cost, so a
later job can record what reusing it saved. The index for near and semantic lookups is stored as
append-only segments (one per job partition, replaced when that partition runs again), so workers
never overwrite each other's entries: a lookup loads every segment of its (tenant scope, recipe).
The stores keep segments as opaque blobs; pipeline/dedup/index.py owns their format.

`ResilientStore` wraps either: a store that is down, slow or full costs one warning, and the job
goes on with caching bypassed (`bypassed` tells the ledger); nothing is lost and nothing crashes.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class CacheStore(Protocol):
    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]: ...
    def put_many(self, scope: str, values: dict[str, dict]) -> None: ...
    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None: ...
    def segments(self, scope: str, recipe: str) -> dict[str, bytes]: ...
    def close(self) -> None: ...


class LocalStore:
    """SQLite under a folder: one file, safe for several processes on one machine (WAL, busy timeout)."""

    def __init__(self, path: str | Path, ttl_seconds: float | None = None):
        Path(path).mkdir(parents=True, exist_ok=True)
        self.ttl = ttl_seconds
        self.db = sqlite3.connect(Path(path) / "cache.sqlite", timeout=60, check_same_thread=False)
        self.lock = threading.Lock()
        with self.lock, self.db:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS entries (scope TEXT, key TEXT, value TEXT, expires REAL,"
                            " PRIMARY KEY (scope, key))")
            self.db.execute("CREATE TABLE IF NOT EXISTS segments (scope TEXT, recipe TEXT, segment TEXT, data BLOB,"
                            " PRIMARY KEY (scope, recipe, segment))")

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        with self.lock:
            for start in range(0, len(keys), 500):
                chunk = keys[start:start + 500]
                rows = self.db.execute(
                    f"SELECT key, value FROM entries WHERE scope = ? AND key IN ({','.join('?' * len(chunk))})"
                    " AND (expires IS NULL OR expires > ?)", [scope, *chunk, time.time()])
                out.update((k, json.loads(v)) for k, v in rows)
        return out

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        expires = time.time() + self.ttl if self.ttl else None
        with self.lock, self.db:
            self.db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                                [(scope, k, json.dumps(v), expires) for k, v in values.items()])

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT OR REPLACE INTO segments VALUES (?, ?, ?, ?)", (scope, recipe, segment, data))

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        with self.lock:
            rows = self.db.execute("SELECT segment, data FROM segments WHERE scope = ? AND recipe = ?", (scope, recipe))
            return {s: bytes(d) for s, d in rows}

    def close(self) -> None:
        self.db.close()


class RedisStore:
    """Redis: `<namespace>:<scope>:v:<key>` holds a value (with TTL); `<namespace>:<scope>:ix:<recipe>` a hash of segments."""

    CHUNK = 1000  # keys per MGET / pipeline round trip

    def __init__(self, url: str, namespace: str, ttl_seconds: float | None = None, timeout_seconds: float = 2.0):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds)
        self.namespace, self.ttl = namespace, ttl_seconds

    def _key(self, scope: str, kind: str, name: str) -> str:
        return f"{self.namespace}:{scope}:{kind}:{name}"

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for start in range(0, len(keys), self.CHUNK):
            chunk = keys[start:start + self.CHUNK]
            for key, value in zip(chunk, self.client.mget([self._key(scope, "v", k) for k in chunk])):
                if value is not None:
                    out[key] = json.loads(value)
        return out

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        items = list(values.items())
        ttl = int(self.ttl) if self.ttl else None
        for start in range(0, len(items), self.CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for key, value in items[start:start + self.CHUNK]:
                pipe.set(self._key(scope, "v", key), json.dumps(value), ex=ttl)
            pipe.execute()

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        self.client.hset(self._key(scope, "ix", recipe), segment, data)

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self.client.hgetall(self._key(scope, "ix", recipe)).items()}

    def close(self) -> None:
        self.client.close()


class ResilientStore:
    """Any store, made safe: the first failure logs one warning and bypasses the store for the rest of the job."""

    def __init__(self, store: CacheStore | None, describe: str, error: str | None = None):
        self.store, self.describe = store, describe
        self.bypassed = error is not None
        if error:
            log.warning("cache %s unavailable, continuing without it: %s", describe, error)

    def _call(self, what: str, fn, default):
        if self.bypassed or self.store is None:
            return default
        try:
            return fn()
        except Exception as e:  # connection refused, timeout, OOM ("full"), corrupt file: all mean "go on without"
            self.bypassed = True
            log.warning("cache %s failed on %s, continuing without it for this job: %s: %s",
                        self.describe, what, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return default

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        return self._call("read", lambda: self.store.get_many(scope, keys), {}) if keys else {}

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        if values:
            self._call("write", lambda: self.store.put_many(scope, values), None)

    # Index entries are comparable only within one way of computing signatures and embeddings: the
    # format names the index, so entries of another format are never compared (they stay, unread, until
    # the cache store is cleared; exact reuse by item key is unaffected).
    # 2: one-permutation MinHash, embeddings without the tokenizer's padding.
    INDEX_FORMAT = "2"

    def _index(self, recipe: str) -> str:
        return f"{recipe}@{self.INDEX_FORMAT}"

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        self._call("index write", lambda: self.store.put_segment(scope, self._index(recipe), segment, data), None)

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        return self._call("index read", lambda: self.store.segments(scope, self._index(recipe)), {})

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass


def open_store(config) -> ResilientStore:
    """The configured cache store (`config` is a CacheConfig), wrapped; disabled or unreachable -> bypassed."""
    if not config.enabled:
        return ResilientStore(None, "off")
    ttl = config.ttl_days * 86400 if config.ttl_days else None
    if config.store == "redis":
        describe = f"redis {config.redis_url.split('@')[-1]}"
        try:
            store = RedisStore(config.redis_url, config.namespace, ttl, config.timeout_seconds)
            store.client.ping()
            return ResilientStore(store, describe)
        except Exception as e:
            return ResilientStore(None, describe, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    describe = f"local {config.path}"
    try:
        return ResilientStore(LocalStore(config.path, ttl), describe)
    except Exception as e:
        return ResilientStore(None, describe, f"{type(e).__name__}: {e}")
