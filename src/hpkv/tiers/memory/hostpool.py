"""The host pool: one process per pool directory that owns the memory tier every engine on the host
shares, so a chunk one engine stored is a memory hit for every other engine of the same model, and
the pool outlives the engines' restarts.

    hpkv pool serve  [--dir /dev/shm/hpkv]   run it in the foreground (a systemd unit)
    hpkv pool status [--dir ...]             who uses it, what it holds
    hpkv pool stop   [--dir ...]             stop it (its files go with it)

An engine that finds none running starts one (:func:`hpkv.tiers.memory.hostslots.connect`), in a
session of its own so that stopping the engine's process group leaves it running. It stops
``--idle-timeout`` seconds after its last engine disconnected, when its socket is removed (its
directory deleted), or on ``hpkv pool stop`` / SIGTERM; its pool files are removed then.

Design: the pool's bytes are shared memory files the engines map (one per model and rank, created
here: :mod:`hpkv.tiers.memory.files`); this process holds only the bookkeeping, one
:class:`~hpkv.tiers.memory.bookkeeping.MemorySlots` per model (which chunk is in which slot, global LRU, pins,
protection, the reset epoch). Engines ask over a Unix socket in the directory, a request per batch
of keys (a lookup's chunks in one round trip), answered in order by one thread: each answer is a
few dictionary operations, so N engines cost N round trips, not N lock hand-offs per chunk.

Pins, protections and reservations are leases of the connection that took them: when an engine's
connection closes (it exited, or was killed with SIGKILL at any moment), every slot it pinned or
reserved and every chunk it protected is let go. A reserved slot becomes visible only by its
writer's ``commit``, after the bytes are written and sealed, so a chunk half-written by a killed
engine is never seen; every record also carries its own checksum, checked on every load.

Only this user's processes may connect (``SO_PEERCRED``); with ``HPKV_SHARED_GROUP`` also the
directory's group. No code-executing format: requests are length-prefixed JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hpkv.tiers.memory.bookkeeping import MemorySlots
from hpkv.tiers.memory.files import create_pool_file, reclaim_stale, unlink_quietly
from hpkv.tiers.memory.wire import HEADER, MAX_MESSAGE, PIDFILE, SOCKET, decode, send

log = logging.getLogger("hpkv.pool")

SEND_TIMEOUT_S = 5.0


# -- the pool's state ----------------------------------------------------------------------------


@dataclass
class Group:
    """One model's pool: its files (one per rank) and its bookkeeping."""

    tag: str
    ranks: int
    slot_bytes: int
    size: int
    paths: list[str]
    fds: list[int]
    slots: MemorySlots


@dataclass
class Lease:
    """What one connection holds; all of it is let go when the connection closes."""

    peer: str
    group: Group | None = None
    pins: Counter[int] = field(default_factory=Counter)
    protected: Counter[str] = field(default_factory=Counter)
    reserved: set[int] = field(default_factory=set)
    inbuf: bytearray = field(default_factory=bytearray)


class HostPool:
    def __init__(self, directory: str, idle_timeout: float, shared_group: bool = False) -> None:
        self.dir = os.path.abspath(directory)
        self.idle_timeout = idle_timeout
        self.shared_group = shared_group
        self.groups: dict[str, Group] = {}
        self.leases: dict[socket.socket, Lease] = {}
        self.sel = selectors.DefaultSelector()
        self.stopping = False
        self.idle_since = time.monotonic()
        self.requests = 0
        self.socket_ino = 0
        self.reclaimed = 0  # pins and reservations let go for connections that closed holding them

    # -- lifecycle ------------------------------------------------------------------------------

    def serve(self) -> int:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        pid_fd = os.open(os.path.join(self.dir, PIDFILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(pid_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("hpkv pool: another pool process serves %s", self.dir)
            return 0
        os.ftruncate(pid_fd, 0)
        os.write(pid_fd, f"{os.getpid()}\n".encode())
        reclaim_stale(self.dir)
        path = os.path.join(self.dir, SOCKET)
        unlink_quietly(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o007 if self.shared_group else 0o077)
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(128)
        listener.setblocking(False)
        ino = self.socket_ino = os.stat(path).st_ino
        self.sel.register(listener, selectors.EVENT_READ, None)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        log.info("hpkv pool: serving %s (pid %d)", self.dir, os.getpid())
        try:
            while not self.stopping:
                for key, _ in self.sel.select(timeout=1.0):
                    if key.data is None:
                        self._accept(listener)
                    else:
                        self._readable(key.fileobj)  # type: ignore[arg-type]
                if self._should_stop(path, ino):
                    break
        finally:
            self.close(listener, path, pid_fd)
            log.info("hpkv pool: stopped after %d requests; its files are removed", self.requests)
        return 0

    def _should_stop(self, path: str, ino: int) -> bool:
        try:
            if os.stat(path).st_ino != ino:
                log.info("hpkv pool: its socket was replaced or removed; stopping")
                return True
        except OSError:
            log.info("hpkv pool: its directory or socket is gone; stopping")
            return True
        if self.leases or self.idle_timeout <= 0:
            return False
        if time.monotonic() - self.idle_since >= self.idle_timeout:
            log.info("hpkv pool: no engine for %.0f s; stopping", self.idle_timeout)
            return True
        return False

    def close(self, listener: socket.socket, path: str, pid_fd: int) -> None:
        for conn in list(self.leases):
            self._drop(conn)
        self.sel.unregister(listener)
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == self.socket_ino:  # not a newer pool's socket
                os.unlink(path)
        for g in self.groups.values():
            for p, fd in zip(g.paths, g.fds, strict=True):
                unlink_quietly(p)
                os.close(fd)
        self.groups.clear()
        os.close(pid_fd)

    # -- connections ------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        peer = self._peer(conn)
        if peer is None:
            conn.close()
            return
        conn.setblocking(False)
        self.leases[conn] = Lease(peer)
        self.sel.register(conn, selectors.EVENT_READ, True)

    def _peer(self, conn: socket.socket) -> str | None:
        """``pid N uid U`` of a peer allowed in (this user; with a shared group, its members), else None."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        if uid == os.geteuid() or uid == 0:
            return f"pid {pid}"
        if self.shared_group and gid == os.stat(self.dir).st_gid:
            return f"pid {pid} uid {uid}"
        log.warning("hpkv pool: refused a connection from pid %d, uid %d", pid, uid)
        return None

    def _readable(self, conn: socket.socket) -> None:
        lease = self.leases[conn]
        try:
            data = conn.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        lease.inbuf += data
        while len(lease.inbuf) >= HEADER.size:
            (n,) = HEADER.unpack_from(lease.inbuf)
            if n > MAX_MESSAGE:
                self._drop(conn)
                return
            if len(lease.inbuf) < HEADER.size + n:
                return
            body = bytes(lease.inbuf[HEADER.size : HEADER.size + n])
            del lease.inbuf[: HEADER.size + n]
            try:
                req = decode(body)
                reply = self.handle(lease, req)
            except Exception as e:  # a bad request ends that connection, never the pool
                log.warning("hpkv pool: bad request from %s: %s", lease.peer, e)
                self._drop(conn)
                return
            try:
                # An engine reads each answer at once; one that does not within SEND_TIMEOUT_S is
                # stuck and is dropped rather than stalling every other engine.
                conn.settimeout(SEND_TIMEOUT_S)
                send(conn, reply)
                conn.setblocking(False)
            except OSError:
                self._drop(conn)
                return

    def _drop(self, conn: socket.socket) -> None:
        """The connection is gone: let go of everything it held."""
        lease = self.leases.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn)
        conn.close()
        if lease is None:
            return
        g = lease.group
        if g is not None:
            held = sum(lease.pins.values()) + len(lease.reserved)
            for slot, n in lease.pins.items():
                g.slots.unpin([slot] * n)
            for slot in lease.reserved:
                g.slots.abort(slot)
            g.slots.unprotect(bytes.fromhex(k) for k, n in lease.protected.items() for _ in range(n))
            if held:
                self.reclaimed += held
                log.info("hpkv pool: %s left holding %d slots; let go", lease.peer, held)
        if not self.leases:
            self.idle_since = time.monotonic()

    # -- requests --------------------------------------------------------------------------------

    def handle(self, lease: Lease, req: dict[str, Any]) -> dict[str, Any]:
        self.requests += 1
        op = req["op"]
        if op == "hello":
            return self._hello(lease, req)
        if op == "status":
            return self.status()
        if op == "stop":
            self.stopping = True
            return {"ok": True}
        g = lease.group
        if g is None:
            raise ValueError(f"{op!r} before hello")
        m = g.slots
        out: dict[str, Any]
        if op == "pin":
            slots = m.pin(bytes.fromhex(k) for k in req["keys"])
            lease.pins.update(slots)
            out = {"slots": slots}
        elif op == "pin_each":
            got = m.pin_each([bytes.fromhex(k) for k in req["keys"]])
            lease.pins.update(got.values())
            out = {"slots": [[i, s] for i, s in got.items()]}
        elif op == "unpin":
            mine = [s for s in req["slots"] if self._take(lease.pins, s)]
            m.unpin(mine)
            out = {}
        elif op == "protect":
            lease.protected.update(req["keys"])
            m.protect(bytes.fromhex(k) for k in req["keys"])
            out = {}
        elif op == "unprotect":
            mine = [k for k in req["keys"] if self._take(lease.protected, k)]
            m.unprotect(bytes.fromhex(k) for k in mine)
            out = {}
        elif op == "reserve":
            before = m.counters.snapshot()["evictions"]
            slot = m.reserve()
            if slot is not None:
                lease.reserved.add(slot)
            out = {"slot": slot, "evicted": m.counters.snapshot()["evictions"] > before}
        elif op == "reserve_many":
            before = m.counters.snapshot()["evictions"]
            fresh = m.reserve_many(int(req["n"]))
            lease.reserved.update(fresh)
            out = {"slots": fresh, "evicted": m.counters.snapshot()["evictions"] - before}
        elif op == "commit":
            out = {"ok": self._commit(lease, int(req["slot"]), req["key"], bool(req["keep_pin"]))}
        elif op == "commit_many":
            out = {"ok": [self._commit(lease, int(s), k, bool(keep)) for s, k, keep in req["items"]]}
        elif op == "abort":
            slot = int(req["slot"])
            if slot in lease.reserved:
                lease.reserved.discard(slot)
                m.abort(slot)
            out = {}
        elif op == "drop":
            m.drop(bytes.fromhex(req["key"]))
            out = {}
        elif op == "reset":
            m.reset()
            out = {}
        elif op == "contains":
            out = {"in": bytes.fromhex(req["key"]) in m}
        elif op == "contains_many":
            out = {"in": m.contains_many([bytes.fromhex(k) for k in req["keys"]])}
        elif op == "len":
            out = {"n": len(m)}
        elif op == "protected":
            out = {"n": m.protected()}
        elif op == "room":
            out = {"n": m.room()}
        elif op == "check":
            m.check()
            out = {}
        else:
            raise ValueError(f"unknown op {op!r}")
        out["pinned"] = m.pinned()
        return out

    @staticmethod
    def _commit(lease: Lease, slot: int, key: str, keep_pin: bool) -> bool:
        if slot not in lease.reserved:
            raise ValueError(f"commit of slot {slot} it did not reserve")
        assert lease.group is not None
        lease.reserved.discard(slot)
        ok = lease.group.slots.commit(slot, bytes.fromhex(key), keep_pin=keep_pin)
        if ok and keep_pin:
            lease.pins[slot] += 1
        return ok

    @staticmethod
    def _take(held: Counter[Any], item: Any) -> bool:
        """Take one of ``item`` back from what a connection holds; False if it holds none."""
        if held[item] <= 0:
            held.pop(item, None)
            return False
        held[item] -= 1
        if not held[item]:
            del held[item]
        return True

    def _hello(self, lease: Lease, req: dict[str, Any]) -> dict[str, Any]:
        tag, ranks, slot_bytes, size = (
            str(req["group"]),
            int(req["ranks"]),
            int(req["slot_bytes"]),
            int(req["size"]),
        )
        if not tag.isalnum() or not 0 < ranks <= 1024 or slot_bytes <= 0 or size < slot_bytes:
            raise ValueError(f"bad hello {req}")
        key = f"{tag}w{ranks}s{slot_bytes}"
        if key not in self.groups:
            made = self._create(key, ranks, slot_bytes, size, req)
            if isinstance(made, dict):
                return made  # an error the engine reports
            self.groups[key] = made
        g = self.groups[key]
        if req.get("bind", True):
            if lease.group is not None and lease.group is not g:
                raise ValueError("a connection serves one model")
            lease.group = g
        return {"paths": g.paths, "size": g.size, "num_slots": g.slots.num_slots, "pid": os.getpid()}

    def _create(
        self, key: str, ranks: int, slot_bytes: int, size: int, req: dict[str, Any]
    ) -> Group | dict[str, Any]:
        paths: list[str] = []
        fds: list[int] = []
        try:
            for r in range(ranks):
                p = os.path.join(self.dir, f"hpkv-{os.getpid()}-{key}r{r}.shm")
                fds.append(
                    create_pool_file(
                        p,
                        size,
                        where=str(req.get("where", "HPKV_KV_MEM_POOL_SIZE")),
                        path_where=str(req.get("path_where", "HPKV_SHARE_MEM_FILE_PATH")),
                        shared_group=self.shared_group,
                    )
                )
                paths.append(p)
        except Exception as e:
            for p, fd in zip(paths, fds, strict=True):
                unlink_quietly(p)
                os.close(fd)
            return {"error": str(e)}
        log.info("hpkv pool: a pool for %s: %d rank(s) of %d bytes", key, ranks, size)
        return Group(key, ranks, slot_bytes, size, paths, fds, MemorySlots(size // slot_bytes))

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "dir": self.dir,
            "engines": sorted(x.peer for x in self.leases.values() if x.group is not None),
            "connections": len(self.leases),
            "requests": self.requests,
            "reclaimed": self.reclaimed,
            "groups": {
                k: {
                    "ranks": g.ranks,
                    "size": g.size,
                    "slots": g.slots.num_slots,
                    "chunks": len(g.slots),
                    "pinned": g.slots.pinned(),
                    "protected": g.slots.protected(),
                    "evictions": g.slots.counters.snapshot()["evictions"],
                }
                for k, g in self.groups.items()
            },
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv pool serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", required=True, help="the pool directory (HPKV_SHARE_MEM_FILE_PATH)")
    ap.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        help="seconds without engines before it stops (0: never)",
    )
    ap.add_argument("--shared-group", action="store_true", help="let the directory's group connect too")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    return HostPool(args.dir, args.idle_timeout, args.shared_group).serve()


if __name__ == "__main__":
    sys.exit(main())
