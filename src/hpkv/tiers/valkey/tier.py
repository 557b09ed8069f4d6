"""The valkey tier: one key per chunk holding the whole sealed record.

``hpkv:<tenant>:<namespace>:<key>`` -> the record (64-byte header + payload), so one GET
fetches a chunk and a value written by another model, layout or hpkv version
fails the header check. Reads go straight into the caller's buffer (GLIDE's
``buffer=``); a value of any other length, or one that fails verification, is
a miss. Writes send the caller's memory without a Python-side copy.

:class:`ValkeyConnection` is the worker pool shared by every rank's tier of
one process; :class:`ValkeyTier` is one namespace's view of it.

Thread-safety: all methods may be called from any thread. Every call waits at
most about ``request_timeout`` (plus queueing behind higher-priority jobs);
while the server is down they return misses at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.stats import TierStats
from hpkv.tiers.base import Built
from hpkv.tiers.valkey.client import ValkeySettings, glide
from hpkv.tiers.valkey.workers import Priority, Unavailable, WorkerPool

log = logging.getLogger(__name__)

NAME = "valkey"
KEY_PREFIX = b"hpkv:"
_LOG_EVERY_S = 30.0
PRESENT_S = 300.0
PRESENT_MAX = 65536


class ValkeyConnection:
    """The worker pool for one remote tier, shared by the tiers of all ranks in a process."""

    def __init__(self, settings: ValkeySettings) -> None:
        glide()  # fail at start, with the install hint, if the client library is missing
        self.settings = settings
        self.pool = WorkerPool(settings)
        self.pool.start()

    @property
    def up(self) -> bool:
        return self.pool.up

    def close(self) -> None:
        self.pool.close()


class ValkeyTier:
    """One rank's keys on the Valkey server(s) (a :class:`hpkv.tiers.base.Tier`); the connection
    (worker threads, clients) is shared by the ranks and closed by its owner."""

    name = NAME
    remote = True

    def __init__(self, conn: ValkeyConnection, payload_bytes: int, namespace: bytes) -> None:
        self.conn = conn
        self.payload_bytes = payload_bytes
        self.record_bytes = record.record_bytes(payload_bytes)
        self.namespace = namespace
        self._ns = namespace[:8].hex().encode()
        self._timeout = conn.settings.request_timeout
        self._ttl = conn.settings.ttl_sec
        self._stats = TierStats()
        self._last_log = 0.0
        # Key names this process wrote or read back verified, lately (bounded; the server may evict
        # or expire a key, so an entry is trusted for PRESENT_S at most).
        self._present: OrderedDict[bytes, float] = OrderedDict()
        self._present_lock = threading.Lock()
        self._present_s = min(PRESENT_S, float(self._ttl)) if self._ttl else PRESENT_S

    def key_name(self, key: bytes, tenant: str = SHARED) -> bytes:
        """``hpkv:<tenant>:<namespace>:<key>``: a tenant's chunks share a prefix an ACL can grant."""
        return b"%s%s:%s:%s" % (KEY_PREFIX, tenant.encode("ascii"), self._ns, key.hex().encode())

    # -- lookups -------------------------------------------------------------------

    def contains(self, key: bytes, tenant: str = SHARED) -> bool:
        return self.contains_many([key], tenant)[0]

    def contains_many(self, keys: list[bytes], tenant: str = SHARED) -> list[bool]:
        """Which of ``keys`` the server holds, in one pipelined round trip. Unknown (down,
        error) counts as absent; each absent key is a counted miss."""
        if not keys:
            return []
        names = [self.key_name(k, tenant) for k in keys]
        cluster = self.conn.settings.cluster

        def job(client: Any) -> list[bool]:
            g = glide()
            batch = g.ClusterBatch(is_atomic=False) if cluster else g.Batch(is_atomic=False)
            for n in names:
                batch.exists([n])
            res = client.exec(batch, raise_on_error=True)
            return [bool(r) for r in res or []]

        got = self._call(Priority.PEEK, job, "exists")
        if not isinstance(got, list) or len(got) != len(keys):
            got = [False] * len(keys)
        for n, present in zip(names, got, strict=True):
            if not present:  # gone (evicted, expired, a restarted server) or unknown: write it again
                self._forget(n)
                self._stats.add("misses")
        return got

    # -- reads ---------------------------------------------------------------------

    def read_into(
        self, key: bytes, buf: memoryview, tenant: str = SHARED, *, priority: Priority = Priority.GET
    ) -> bool:
        """GET the record of ``key`` straight into ``buf`` (≥ the record's length) and verify it.
        True: ``buf`` holds a verified record. False: a counted miss (absent, wrong length,
        failed verification, server down). When this returns, no write into ``buf`` is pending."""
        check = self.fetch_into(key, buf, tenant, priority=priority)
        return check is not None and check()

    def fetch_into(
        self, key: bytes, buf: memoryview, tenant: str = SHARED, *, priority: Priority = Priority.GET
    ) -> Callable[[], bool] | None:
        """:meth:`read_into` in two halves (see the tier protocol): the GET into ``buf`` now (no
        write into it is pending once this returns), and the check that verifies it."""
        name = self.key_name(key, tenant)
        view = memoryview(buf)
        if view.format != "B":  # GLIDE's buffer= takes unsigned bytes only
            view = view.cast("B")
        target = view[: self.record_bytes]

        too_big = glide().RequestError

        def job(client: Any) -> int:
            try:
                got = client.get(name, buffer=target)
            except too_big as e:
                if "exceeds buffer" not in str(e):
                    raise
                return self.record_bytes + 1  # longer than any record: fails the length check below
            return -1 if got is None else int(got)

        n = self._call(priority, job, "get")
        if n is None or n < 0:
            self._stats.add("misses")
            self._forget(name)
            return None
        return lambda: self._verify_get(name, key, view, n)

    def _verify_get(self, name: bytes, key: bytes, view: memoryview, n: int) -> bool:
        verdict = record.verify(view, n, self.namespace, key, self.payload_bytes)
        if n != self.record_bytes or verdict is not record.Verdict.OK:
            verdict = verdict if n == self.record_bytes else record.Verdict.WRONG_LENGTH
            self._stats.add("corrupt")
            self._stats.add("misses")
            self._forget(name)  # the next write of this chunk replaces the bad value
            self._log(
                f"hpkv: valkey value {name.decode()} failed verification ({verdict.value}); treated as a miss"
            )
            return False
        self._stats.add("hits")
        self._stats.add("bytes_read", self.payload_bytes)
        self._remember(name)
        return True

    # -- writes ----------------------------------------------------------------------

    def write(self, key: bytes, rec: memoryview, tenant: str = SHARED) -> bool:
        """SET the sealed record (with the TTL when enabled), replacing whatever value the key
        held: a corrupt or forged value there is overwritten, not kept. A chunk this process
        wrote or read back verified in the last PRESENT_S seconds is not sent again. No EXISTS
        first: it would count as a read in the server's keyspace_hits (the L2 proof) and cost a
        round trip. True if the server holds it now. Sends ``rec`` without copying it in Python."""
        name = self.key_name(key, tenant)
        if self._known(name):
            return True
        value = memoryview(rec)[: self.record_bytes]
        ttl = self._ttl

        def job(client: Any) -> bool:
            g = glide()
            expiry = g.ExpirySet(g.ExpiryType.SEC, ttl) if ttl else None
            client.set(name, value, expiry=expiry)
            return True

        if self._call(Priority.PUT, job, "set") is None:
            self._stats.add("writes_skipped")
            return False
        self._stats.add("writes")
        self._stats.add("bytes_written", self.payload_bytes)
        self._remember(name)
        return True

    def source(self, key: bytes, tenant: str = SHARED) -> str:
        """Every read of this tier crosses the same link: its name."""
        return self.name

    def held(self, key: bytes, tenant: str = SHARED) -> bool:
        """Whether this process wrote or read ``key`` back verified in the last PRESENT_S seconds
        (no network: for callers that must not wait on the server)."""
        return self._known(self.key_name(key, tenant))

    def _known(self, name: bytes) -> bool:
        with self._present_lock:
            t = self._present.get(name)
            return t is not None and time.monotonic() - t < self._present_s

    def _remember(self, name: bytes) -> None:
        with self._present_lock:
            self._present[name] = time.monotonic()
            self._present.move_to_end(name)
            while len(self._present) > PRESENT_MAX:
                self._present.popitem(last=False)

    def _forget(self, name: bytes | None = None) -> None:
        with self._present_lock:
            if name is None:
                self._present.clear()
            else:
                self._present.pop(name, None)

    def delete(self, key: bytes, tenant: str = SHARED) -> bool:
        name = self.key_name(key, tenant)
        self._forget(name)
        return bool(self._call(Priority.PUT, lambda c: c.delete([name]), "del"))

    def clear(self) -> int:
        """Delete every chunk of this namespace on the server (other namespaces and keys stay)."""
        pattern = KEY_PREFIX + b"*:" + self._ns + b":*"
        self._forget()
        cluster = self.conn.settings.cluster

        def job(client: Any) -> int:
            n = 0
            if cluster:
                cursor = glide().ClusterScanCursor()
                while not cursor.is_finished():
                    cursor, names = client.scan(cursor, match=pattern, count=1000)
                    for name in names:  # one DEL per key: keys of one batch live on many nodes
                        n += client.delete([name])
                return n
            pos = b"0"
            while True:
                pos, names = client.custom_command([b"SCAN", pos, b"MATCH", pattern, b"COUNT", b"1000"])
                if names:
                    n += client.delete(list(names))
                if pos in (b"0", 0, "0"):
                    return n

        return int(self._call(Priority.PUT, job, "clear", timeout=None) or 0)

    # -- housekeeping ------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot(connected=int(self.conn.up), reconnects=self.conn.pool.reconnects)

    def count(self, name: str, n: int = 1) -> None:
        self._stats.add(name, n)

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass  # the connection is closed by its owner

    def _call(self, priority: Priority, job: Any, what: str, timeout: float | None = -1.0) -> Any:
        """Run ``job`` on the pool; None (counted as an error when it was not just 'down') on failure."""
        wait = self._timeout * 2 + 1.0 if timeout == -1.0 else timeout
        try:
            return self.conn.pool.run(priority, job, timeout=wait)
        except Unavailable:
            return None
        except TimeoutError:
            self._stats.add("errors")
            self._log(f"hpkv: valkey {what} waited more than {wait:.1f}s in the queue; treated as a miss")
            return None
        except Exception as e:
            self._stats.add("errors")
            self._log(f"hpkv: valkey {what} failed ({type(e).__name__}: {e}); treated as a miss")
            return None

    def _log(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log > _LOG_EVERY_S:
            self._last_log = now
            log.warning(msg)


def from_config(config: HpkvConfig, payload_bytes: int, rank_digests: list[bytes]) -> Built | None:
    """One valkey tier per rank over one shared connection (the registry's builder)."""
    settings = ValkeySettings.from_config(config)
    if settings is None:
        return None
    conn = ValkeyConnection(settings)
    return Built([ValkeyTier(conn, payload_bytes, d) for d in rank_digests], conn.close)
