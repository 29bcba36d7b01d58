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

`forget(scope)` removes one scope's values and index segments exactly (`tokenmill cache forget`):
in Redis a scope is percent-encoded inside its keys, so it never holds a `:` or a glob character and
no tenant's keys start with another tenant's prefix (`acme` vs `acme:x`, or a tenant named `*`).
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, urlsplit

from pipeline.config.env import redact_url, scrub, url_error

log = logging.getLogger(__name__)


class CacheStore(Protocol):
    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]: ...
    def put_many(self, scope: str, values: dict[str, dict]) -> None: ...
    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None: ...
    def segments(self, scope: str, recipe: str) -> dict[str, bytes]: ...
    def forget(self, scope: str) -> dict[str, int]: ...  # {"entries": n, "segments": m} removed
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
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS entries (scope TEXT, key TEXT, value TEXT, expires REAL,"
                " PRIMARY KEY (scope, key))"
            )
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS segments (scope TEXT, recipe TEXT, segment TEXT, data BLOB,"
                " PRIMARY KEY (scope, recipe, segment))"
            )

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        with self.lock:
            for start in range(0, len(keys), 500):
                chunk = keys[start : start + 500]
                rows = self.db.execute(
                    f"SELECT key, value FROM entries WHERE scope = ? AND key IN ({','.join('?' * len(chunk))})"
                    " AND (expires IS NULL OR expires > ?)",
                    [scope, *chunk, time.time()],
                )
                out.update((k, json.loads(v)) for k, v in rows)
        return out

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        expires = time.time() + self.ttl if self.ttl else None
        with self.lock, self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                [(scope, k, json.dumps(v), expires) for k, v in values.items()],
            )

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT OR REPLACE INTO segments VALUES (?, ?, ?, ?)", (scope, recipe, segment, data))

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        with self.lock:
            rows = self.db.execute("SELECT segment, data FROM segments WHERE scope = ? AND recipe = ?", (scope, recipe))
            return {s: bytes(d) for s, d in rows}

    def forget(self, scope: str) -> dict[str, int]:
        with self.lock, self.db:
            entries = self.db.execute("DELETE FROM entries WHERE scope = ?", (scope,)).rowcount
            segments = self.db.execute("DELETE FROM segments WHERE scope = ?", (scope,)).rowcount
        return {"entries": entries, "segments": segments}

    def close(self) -> None:
        self.db.close()


def redis_url(url: str) -> str:
    """`url` with `/`, `?`, `#` and `@` percent-encoded in its password when they were left raw.

    redis-py cuts the host at the first `/`, `?` or `#`, so `redis://:ab/cd@host/0` would connect to
    the wrong place and quote `ab` in its error. Such a URL (its standard parse has no host, a port that
    is not a number, or a path that is not a db number) is read with the userinfo ending at the last `@`
    and encoded, which redis-py decodes back: a password may hold any character."""
    head, sep, rest = url.partition("://")
    at, cut = rest.rfind("@"), min((i for i in map(rest.find, "/?#") if i >= 0), default=-1)
    if not sep or at < 0 or cut < 0 or at < cut:
        return url
    try:
        parts = urlsplit(url)
        # `parts.port` raises ValueError when the port is not a number.
        broken = not (parts.hostname and re.fullmatch(r"(/\d*)?", parts.path) and (parts.port or True))
    except ValueError:
        broken = True
    return f"{head}://{quote(rest[:at], safe=':%')}@{rest[at + 1 :]}" if broken else url


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis SCAN MATCH pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisStore:
    """Redis: `<namespace>:<scope>:v:<key>` holds a value (with TTL); `<namespace>:<scope>:ix:<recipe>` a hash of
    segments. The scope is percent-encoded (`t=acme%3Ax` for tenant `acme:x`, `t=%2A` for `*`): keys and recipes
    are hashes without `:`, so `<namespace>:<scope>:` is a prefix of that scope's keys and no other's."""

    CHUNK = 1000  # keys per MGET / pipeline round trip

    def __init__(self, url: str, namespace: str, ttl_seconds: float | None = None, timeout_seconds: float = 2.0):
        import redis

        self.client = redis.Redis.from_url(
            redis_url(url), socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        self.url, self.namespace, self.ttl = url, namespace, ttl_seconds  # url: to scrub from errors

    def _prefix(self, scope: str) -> str:
        return f"{self.namespace}:{quote(scope, safe='=')}:"

    def _key(self, scope: str, kind: str, name: str) -> str:
        return f"{self._prefix(scope)}{kind}:{name}"

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for start in range(0, len(keys), self.CHUNK):
            chunk = keys[start : start + self.CHUNK]
            for key, value in zip(chunk, self.client.mget([self._key(scope, "v", k) for k in chunk])):
                if value is not None:
                    out[key] = json.loads(value)
        return out

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        items = list(values.items())
        ttl = int(self.ttl) if self.ttl else None
        for start in range(0, len(items), self.CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for key, value in items[start : start + self.CHUNK]:
                pipe.set(self._key(scope, "v", key), json.dumps(value), ex=ttl)
            pipe.execute()

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        self.client.hset(self._key(scope, "ix", recipe), segment, data)

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self.client.hgetall(self._key(scope, "ix", recipe)).items()}

    def forget(self, scope: str) -> dict[str, int]:
        prefix = self._prefix(scope)
        own = re.compile(re.escape(prefix) + r"(v|ix):[^:]*")  # exact: not another namespace that starts alike
        removed = {"entries": 0, "segments": 0}
        keys = [
            k
            for k in self.client.scan_iter(match=_glob_escape(prefix) + "*", count=self.CHUNK)
            if own.fullmatch(k.decode("utf-8", "replace"))
        ]
        for start in range(0, len(keys), self.CHUNK):
            chunk = keys[start : start + self.CHUNK]
            index = [k for k in chunk if k.decode("utf-8", "replace")[len(prefix) :].startswith("ix:")]
            pipe = self.client.pipeline(transaction=False)
            for k in index:
                pipe.hlen(k)
            removed["segments"] += sum(pipe.execute()) if index else 0
            removed["entries"] += self.client.delete(*chunk) - len(index)
        return removed

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
            message = scrub(str(e).splitlines()[0] if str(e) else "", getattr(self.store, "url", None))
            log.warning(
                "cache %s failed on %s, continuing without it for this job: %s: %s",
                self.describe,
                what,
                type(e).__name__,
                message,
            )
            return default

    def get_many(self, scope: str, keys: list[str]) -> dict[str, dict]:
        return self._call("read", lambda: self.store.get_many(scope, keys), {}) if keys else {}

    def get_scoped(self, scope_of: dict[str, str]) -> dict[str, dict]:
        """The values held for keys each in its own scope (`scope_of`: key -> scope), one read per scope."""
        hits: dict[str, dict] = {}
        for scope in sorted(set(scope_of.values())):
            hits |= self.get_many(scope, [k for k, s in scope_of.items() if s == scope])
        return hits

    def put_many(self, scope: str, values: dict[str, dict]) -> None:
        if values:
            self._call("write", lambda: self.store.put_many(scope, values), None)

    # Index entries are comparable only within one way of computing signatures and embeddings: the
    # format names the index, so entries of another format are never compared (they stay, unread, until
    # the cache store is cleared; exact reuse by item key is unaffected).
    # 2: one-permutation MinHash, embeddings without the tokenizer's padding.
    # 3: item keys hash their parts length-prefixed (keys.key_bytes). Every key changed, and entries made
    #    before could have been shared across tenants by the old NUL-joined keys: format-2 segments (which
    #    name old keys) are never read again, and old values, unreachable by the new keys, expire by TTL.
    INDEX_FORMAT = "3"

    def _index(self, recipe: str) -> str:
        return f"{recipe}@{self.INDEX_FORMAT}"

    def put_segment(self, scope: str, recipe: str, segment: str, data: bytes) -> None:
        self._call("index write", lambda: self.store.put_segment(scope, self._index(recipe), segment, data), None)

    def segments(self, scope: str, recipe: str) -> dict[str, bytes]:
        return self._call("index read", lambda: self.store.segments(scope, self._index(recipe)), {})

    def forget(self, scope: str) -> dict[str, int]:
        return self._call("forget", lambda: self.store.forget(scope), {"entries": 0, "segments": 0})

    def close(self) -> None:
        if self.store is not None:
            try:
                self.store.close()
            except Exception:
                pass


def describe_store(config) -> str:
    """The configured store for messages: `redis <url, password hidden>` or `local <path>`."""
    return f"redis {redact_url(config.redis_url)}" if config.store == "redis" else f"local {config.path}"


def connect_store(config) -> CacheStore:
    """The configured cache store itself (`config` is a CacheConfig), reachable; raises when it is not."""
    ttl = config.ttl_days * 86400 if config.ttl_days else None
    if config.store == "redis":
        store = RedisStore(config.redis_url, config.namespace, ttl, config.timeout_seconds)
        store.client.ping()
        return store
    return LocalStore(config.path, ttl)


def open_store(config) -> ResilientStore:
    """The configured cache store (`config` is a CacheConfig), wrapped; disabled or unreachable -> bypassed."""
    if not config.enabled:
        return ResilientStore(None, "off")
    try:
        return ResilientStore(connect_store(config), describe_store(config))
    except Exception as e:  # unreachable, refused, a URL that cannot be parsed: all mean "go on without"
        url = config.redis_url if config.store == "redis" else None
        return ResilientStore(None, describe_store(config), url_error(e, url))
