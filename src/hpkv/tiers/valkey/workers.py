"""A pool of worker threads, each with its own GLIDE client, serving jobs by priority.

Why threads with private clients: a GLIDE sync call releases the GIL while it
waits on the network, so N threads keep N requests in flight; a client is not
shared between threads, and each is created lazily inside its thread, so no
client (and no socket) is ever inherited across a fork.

Priorities (lowest value first): PEEK (existence checks, which a lookup waits
for) > PREFETCH (promotions a request waits for) > GET > PUT (write-behind), so
a lookup never queues behind bulk writes.

Health: the pool is *up* or *down*. While down every job fails at once with
:class:`Unavailable` (a miss to the caller) and one background thread retries
the server with backoff; when it answers, the pool is up again and every
worker makes a fresh client. A job that fails with a connection or timeout
error puts the pool down.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, TypeVar

from hpkv.core.errors import HpkvConfigError
from hpkv.core.procs import name_os_thread
from hpkv.tiers.valkey.client import ValkeySettings, connect, glide

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = Callable[[Any], T]

_RETRY_FIRST_S = 0.25
_RETRY_MAX_S = 5.0
_WARN_EVERY_S = 30.0
_AUTH_ERRORS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username-password")


class Priority(IntEnum):
    PEEK = 0
    PREFETCH = 1
    GET = 2
    PUT = 3


class Unavailable(Exception):
    """The remote tier is down (unreachable, or reconnecting); the caller treats it as a miss."""


class WorkerPool:
    def __init__(
        self, settings: ValkeySettings, connector: Callable[[ValkeySettings], Any] = connect
    ) -> None:
        self.settings = settings
        self._connect = connector
        self._lock = threading.Lock()
        self._up = threading.Event()
        self._gen = 0  # bumped on every reconnect: workers drop clients of older generations
        self._reconnecting = False
        self.reconnects = 0  # times the server was reached again after being marked down
        self._closed = False
        self._last_warn = 0.0
        self.last_error = ""
        self._reset_threads()

    def _reset_threads(self) -> None:
        self._pid = os.getpid()
        self._q: queue.PriorityQueue[tuple[int, int, Job[Any] | None, Future[Any] | None]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._clients: list[Any] = []
        self._local = threading.local()

    # -- health --------------------------------------------------------------------

    def start(self) -> bool:
        """Probe the server once, blocking up to ``connection_timeout``.

        True: up. False: the pool starts down (jobs are misses), a warning is
        logged and a background thread keeps trying to reconnect.
        """
        try:
            self._probe()
        except Exception as e:
            text = str(e)
            if any(m in text for m in _AUTH_ERRORS):
                # Wrong credentials will not heal by retrying: refuse to start, naming the setting.
                raise HpkvConfigError(
                    f"{self.settings.auth_where}: the valkey tier at {self.settings.describe()} refused "
                    f"the credentials ({text.split(': ', 1)[-1].strip()}); use the ACL user and password "
                    "that server knows, e.g. valkey_username: hpkv, valkey_password: s3cret"
                ) from None
            self._mark_down(e, starting=True)
            return False
        self._up.set()
        return True

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def _probe(self) -> None:
        client = self._connect(self.settings)
        try:
            client.ping()
        finally:
            client.close()

    def _mark_down(self, err: BaseException, starting: bool = False) -> None:
        self.last_error = f"{type(err).__name__}: {err}"
        with self._lock:
            was_up = self._up.is_set()
            self._up.clear()
            start = not self._reconnecting and not self._closed
            self._reconnecting = self._reconnecting or start
        now = time.monotonic()
        if starting or was_up or now - self._last_warn > _WARN_EVERY_S:
            self._last_warn = now
            log.warning(
                "hpkv: the valkey tier at %s is unavailable (%s); serving misses and reconnecting "
                "in the background",
                self.settings.describe(),
                self.last_error,
            )
        if start:
            threading.Thread(target=self._reconnect, name="hpkv-valkey-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        name_os_thread()
        delay = _RETRY_FIRST_S
        while not self._closed:
            time.sleep(delay)
            try:
                self._probe()
            except Exception as e:
                self.last_error = f"{type(e).__name__}: {e}"
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            with self._lock:
                self._gen += 1
                self.reconnects += 1
                self._reconnecting = False
                self._up.set()
            log.warning("hpkv: the valkey tier at %s is reachable again", self.settings.describe())
            return
        with self._lock:
            self._reconnecting = False

    # -- jobs ------------------------------------------------------------------------

    def submit(self, priority: Priority, job: Job[T]) -> Future[T]:
        """Queue ``job(client)``; never blocks. The future fails with :class:`Unavailable` while down."""
        fut: Future[T] = Future()
        if not self._up.is_set() or self._closed:
            fut.set_exception(Unavailable(self.last_error or "closed"))
            return fut
        self._ensure_threads()
        self._q.put((int(priority), next(self._seq), job, fut))
        return fut

    def run(self, priority: Priority, job: Job[T], timeout: float | None = None) -> T:
        """Submit and wait. Raises the job's error, :class:`Unavailable`, or TimeoutError when it
        did not start within ``timeout`` (a job that started is always waited for, so it can
        never write into a caller's buffer after this returns)."""
        fut = self.submit(priority, job)
        try:
            return fut.result(timeout=timeout)
        except TimeoutError:
            if fut.cancel():
                raise
            return fut.result()  # running: GLIDE's request_timeout bounds it

    def _ensure_threads(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's threads and clients are not ours
            with self._lock:
                if self._pid != os.getpid():
                    self._reset_threads()
        if len(self._threads) >= self.settings.num_workers:
            return
        with self._lock:
            while len(self._threads) < self.settings.num_workers:
                t = threading.Thread(target=self._work, name=f"hpkv-valkey-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def _client(self) -> Any:
        loc = self._local
        if getattr(loc, "gen", None) != self._gen or loc.client is None:
            old = getattr(loc, "client", None)
            loc.client = None
            if old is not None:
                self._close_client(old)
            client = self._connect(self.settings)
            with self._lock:
                self._clients.append(client)
            loc.client, loc.gen = client, self._gen
        return loc.client

    def _close_client(self, client: Any) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)
        with contextlib.suppress(Exception):
            client.close()

    def _work(self) -> None:
        name_os_thread()
        g = glide()
        down_errors = (g.ConnectionError, g.ClosingError, g.TimeoutError, OSError)
        while True:
            _, _, job, fut = self._q.get()
            if job is None or fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if not self._up.is_set():
                fut.set_exception(Unavailable(self.last_error))
                continue
            try:
                fut.set_result(job(self._client()))
            except down_errors as e:
                old = getattr(self._local, "client", None)
                self._local.client = None
                if old is not None:
                    self._close_client(old)
                self._mark_down(e)
                fut.set_exception(Unavailable(self.last_error))
            except BaseException as e:
                # Drop the traceback: its frames would keep the caller's buffer exported
                # (cffi's from_buffer) after the caller has moved on.
                fut.set_exception(e.with_traceback(None))

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._q.put((-1, next(self._seq), None, None))
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:
            with contextlib.suppress(Exception):
                c.close()
