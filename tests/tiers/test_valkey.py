"""The valkey tier through KVStore, against real valkey-server processes (standalone and a cluster)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import torch

from hpkv import HpkvConfigError, KVLayout
from hpkv.bench.throttle import ThrottledProxy
from hpkv.bench.valkey import ValkeyServers, free_port, make_tls_files
from hpkv.core import record
from hpkv.tiers.valkey import ValkeyConnection, ValkeySettings, ValkeyTier
from hpkv.tiers.valkey.workers import Priority
from tests.conftest import CHUNK, SMALL, StoreFactory, bits_equal, random_kv, random_tokens


def remote(server: ValkeyServers, **cfg: Any) -> dict[str, Any]:
    """Config keywords for a store whose only tier is valkey."""
    cfg.setdefault("mem_pool_size", 0)
    cfg.setdefault("storage_path", None)
    cfg.setdefault("request_timeout", 2.0)
    cfg.setdefault("connection_timeout", 2.0)
    return {"remote_url": server.url, "valkey_mode": server.mode, **cfg}


def wait_for(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.mark.parametrize("which", ["standalone", "cluster"])
def test_round_trip_valkey_only_one_exists_and_one_get_per_chunk(
    make_store: StoreFactory, valkey_server: ValkeyServers, valkey_cluster: ValkeyServers, which: str
) -> None:
    srv = valkey_server if which == "standalone" else valkey_cluster
    # A fixed seed: hash(which) changed with PYTHONHASHSEED, so which primaries got keys was luck.
    toks = random_tokens(12 * CHUNK + 5, seed=11 if which == "standalone" else 12)
    kv = random_kv(SMALL, len(toks))
    a = make_store(model_id=f"only-{which}", **remote(srv))
    assert a.tier_names() == ["valkey"]
    assert a.put(toks, kv) == 12 * CHUNK
    a.flush()
    assert a.locate(toks) == ["valkey"] * 12
    hits = srv.keyspace_hits()
    out = a.get(toks)
    # The lookup's one batched EXISTS and one GET per chunk, summed over every primary.
    assert srv.keyspace_hits() - hits == 2 * 12
    assert bits_equal(out, kv[:, :, : 12 * CHUNK])
    st = a.stats()["valkey"]
    assert st["hits"] == 12 and st["writes"] == 12 and st["connected"] == 1
    if which == "cluster":
        mine = [len(c.command("KEYS", "hpkv:*")) for c in map(srv.admin, range(3))]
        assert all(n > 0 for n in mine), f"keys not spread over the primaries: {mine}"
    a.clear(("valkey",))
    assert a.lookup(toks) == 0


def test_mixed_hit_memory_storage_valkey(make_store: StoreFactory, valkey_server: ValkeyServers) -> None:
    toks = random_tokens(10 * CHUNK, seed=7)
    kv = random_kv(SMALL, len(toks), seed=7)
    cfg = remote(valkey_server, mem_pool_size="8M", storage_path=make_store.__defaults__ and None)
    cfg.pop("storage_path")  # the fixture's storage directory
    a = make_store(model_id="mixed", **cfg)
    a.put(toks, kv)
    a.flush()
    assert a.storage is not None
    for k in a.keys(toks)[6:]:  # storage loses the tail; valkey still has it
        a.storage.delete(a.record_key(k))
    a.close()
    b = make_store(model_id="mixed", **cfg)
    b.get(toks[: 3 * CHUNK])  # promoted into memory
    assert b.locate(toks) == ["memory"] * 3 + ["storage"] * 3 + ["valkey"] * 4
    before = b.stats()
    hits = valkey_server.keyspace_hits()
    assert bits_equal(b.get(toks), kv)
    after = b.stats()
    assert valkey_server.keyspace_hits() - hits == 2 * 4  # EXISTS for the 4 local gaps, then 4 GETs
    for tier, n in (("memory", 3), ("storage", 3), ("valkey", 4)):
        assert after[tier]["hits"] - before[tier]["hits"] == n, tier
    assert b.locate(toks) == ["memory"] * 10  # every slower hit was promoted
    b.clear(("valkey",))


def test_ttl_only_when_enabled(make_store: StoreFactory, valkey_server: ValkeyServers) -> None:
    toks = random_tokens(2 * CHUNK, seed=11)
    kv = random_kv(SMALL, len(toks))
    for enabled, model in ((True, "ttl-on"), (False, "ttl-off")):
        s = make_store(model_id=model, **remote(valkey_server, valkey_enable_ttl=enabled, valkey_ttl_sec=300))
        s.put(toks, kv)
        s.flush()
        assert s.valkey is not None
        names = [s.valkey.key_name(s.record_key(k)) for k in s.keys(toks)]
        ttls = [valkey_server.admin().command("TTL", n) for n in names]
        if enabled:
            assert all(0 < t <= 300 for t in ttls), ttls
        else:
            assert ttls == [-1, -1]
        s.clear(("valkey",))


@pytest.mark.parametrize("damage", ["truncated", "oversize", "flipped", "foreign_namespace", "evicted"])
def test_bad_values_are_misses(make_store: StoreFactory, valkey_server: ValkeyServers, damage: str) -> None:
    toks = random_tokens(4 * CHUNK, seed=13)
    kv = random_kv(SMALL, len(toks))
    s = make_store(model_id=f"bad-{damage}", **remote(valkey_server))
    s.put(toks, kv)
    s.flush()
    assert s.lookup(toks) == 4 * CHUNK
    assert s.valkey is not None
    name = s.valkey.key_name(s.record_key(s.keys(toks)[2]))
    adm = valkey_server.admin()
    value = adm.command("GET", name)
    if damage == "truncated":
        adm.command("SET", name, value[:-100])
    elif damage == "oversize":
        adm.command("SET", name, value + b"\0" * 4096)
    elif damage == "flipped":
        adm.command("SET", name, value[:-1] + bytes([value[-1] ^ 1]))
    elif damage == "foreign_namespace":
        # Another model/layout wrote under the same key name: a well-formed record, wrong namespace.
        other = bytearray(value)
        rk = s.record_key(s.keys(toks)[2])
        record.seal(memoryview(other), b"\x01" * 16, rk, len(value) - record.HEADER_BYTES)
        adm.command("SET", name, bytes(other))
    else:
        adm.command("DEL", name)  # evicted or expired between lookup and load
    out = s.get(toks)
    assert bits_equal(out, kv[:, :, : 2 * CHUNK])  # the verified prefix, never the damaged chunk
    st = s.stats()["valkey"]
    assert st["misses"] >= 1
    assert st["corrupt"] == (0 if damage == "evicted" else 1)
    s.clear(("valkey",))


def test_server_killed_and_restarted_mid_run(make_store: StoreFactory, tmp_path: Any) -> None:
    with ValkeyServers(directory=str(tmp_path / "v")) as srv:
        s = make_store(model_id="kill", **remote(srv, request_timeout=1.0))
        toks = random_tokens(3 * CHUNK, seed=17)
        kv = random_kv(SMALL, len(toks))
        s.put(toks, kv)
        s.flush()
        srv.kill()
        t0 = time.monotonic()
        assert s.get(toks).shape[2] == 0  # misses, no exception
        assert s.lookup(toks) == 0
        assert time.monotonic() - t0 < 2 * 1.0 + 1.5  # bounded by request_timeout
        assert s.valkey is not None and s.stats()["valkey"]["connected"] == 0
        skipped = s.stats()["valkey"]["writes_skipped"]
        s.put(toks, kv)  # queued for the cascade, which drops it (counted) instead of hanging
        s.flush()
        assert s.stats()["valkey"]["writes_skipped"] - skipped == 3
        assert s.stats()["valkey"]["reconnects"] == 0
        srv.restart()  # empty server on the same port
        wait_for(lambda: s.stats()["valkey"]["connected"] == 1)
        assert s.stats()["valkey"]["reconnects"] == 1
        assert s.put(toks, kv) == 3 * CHUNK
        s.flush()
        assert bits_equal(s.get(toks), kv)


def test_unreachable_at_start_is_degraded_then_reconnects(make_store: StoreFactory, tmp_path: Any) -> None:
    port = free_port()
    t0 = time.monotonic()
    s = make_store(
        model_id="late",
        remote_url=f"valkey://127.0.0.1:{port}",
        mem_pool_size=0,
        storage_path=None,
        connection_timeout=1.0,
        request_timeout=1.0,
    )
    assert time.monotonic() - t0 < 10
    toks = random_tokens(2 * CHUNK, seed=19)
    kv = random_kv(SMALL, len(toks))
    assert s.lookup(toks) == 0 and s.stats()["valkey"]["connected"] == 0
    with ValkeyServers(port=port, directory=str(tmp_path / "v")):
        wait_for(lambda: s.stats()["valkey"]["connected"] == 1)
        assert s.put(toks, kv) == 2 * CHUNK
        s.flush()
        assert bits_equal(s.get(toks), kv)


def test_acl_user(make_store: StoreFactory, valkey_server: ValkeyServers) -> None:
    adm = valkey_server.admin()
    adm.command("ACL", "SETUSER", "hpkvuser", "on", ">right-pw", "~hpkv:*", "+@all")
    toks = random_tokens(2 * CHUNK, seed=23)
    kv = random_kv(SMALL, len(toks))
    s = make_store(
        model_id="acl", **remote(valkey_server, valkey_username="hpkvuser", valkey_password="right-pw")
    )
    s.put(toks, kv)
    s.flush()
    assert bits_equal(s.get(toks), kv)
    s.clear(("valkey",))
    with pytest.raises(HpkvConfigError, match="valkey_password") as e:
        make_store(
            model_id="acl", **remote(valkey_server, valkey_username="hpkvuser", valkey_password="wrong")
        )
    assert "wrong" not in str(e.value).replace("wrong-", "")  # the password is not echoed
    # credentials in the URL work too
    url = valkey_server.url.replace("://", "://hpkvuser:right-pw@")
    s2 = make_store(model_id="acl2", **{**remote(valkey_server), "remote_url": url})
    assert s2.stats()["valkey"]["connected"] == 1


def test_tls_with_a_self_signed_ca(make_store: StoreFactory, tmp_path: Any) -> None:
    tls = make_tls_files(str(tmp_path / "tls"))
    with ValkeyServers(tls=tls, directory=str(tmp_path / "v")) as srv:
        assert srv.url.startswith("valkeys://")
        toks = random_tokens(3 * CHUNK, seed=29)
        kv = random_kv(SMALL, len(toks))
        s = make_store(model_id="tls", **remote(srv, tls_ca_cert=tls.ca_cert))
        s.put(toks, kv)
        s.flush()
        hits = srv.keyspace_hits()
        assert bits_equal(s.get(toks), kv)
        assert srv.keyspace_hits() - hits == 2 * 3  # EXISTS + GET per chunk
        # Without our CA the certificate cannot be verified: degraded (misses), not a crash.
        plain = make_store(model_id="tls", **remote(srv, connection_timeout=1.0))
        assert plain.stats()["valkey"]["connected"] == 0
        assert plain.lookup(toks) == 0


def test_bad_ca_file_is_a_config_error(
    make_store: StoreFactory, valkey_server: ValkeyServers, tmp_path: Any
) -> None:
    with pytest.raises(HpkvConfigError, match=r"tls_ca_cert='/nonexistent.pem' cannot be read"):
        make_store(**remote(valkey_server, tls_ca_cert="/nonexistent.pem"))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(HpkvConfigError, match="holds no PEM certificate"):
        make_store(**remote(valkey_server, tls_ca_cert=str(junk)))


def test_missing_glide_names_the_package(
    make_store: StoreFactory, valkey_server: ValkeyServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "glide_sync", None)  # a missing package cannot be produced for real
    with pytest.raises(HpkvConfigError, match=r"pip install 'valkey-glide-sync>=2.3.0'.*async-only"):
        make_store(**remote(valkey_server))


def test_existence_checks_overtake_queued_writes(valkey_server: ValkeyServers) -> None:
    settings = ValkeySettings(nodes=(("127.0.0.1", valkey_server.nodes[0].port),), num_workers=1)
    conn = ValkeyConnection(settings)
    try:
        order: list[str] = []
        gate = threading.Event()
        first = conn.pool.submit(Priority.PUT, lambda c: gate.wait(10))
        time.sleep(0.2)  # the single worker is now busy
        puts = [conn.pool.submit(Priority.PUT, lambda c, i=i: order.append(f"put{i}")) for i in range(3)]
        get = conn.pool.submit(Priority.GET, lambda c: order.append("get"))
        peek = conn.pool.submit(Priority.PEEK, lambda c: order.append("peek"))
        gate.set()
        for f in [first, *puts, get, peek]:
            f.result(10)
        assert order == ["peek", "get", "put0", "put1", "put2"]
    finally:
        conn.close()


def tier_and_record(
    server: ValkeyServers, ns: bytes, fill: int
) -> tuple[ValkeyConnection, ValkeyTier, bytearray]:
    """A connection, a tier of namespace ``ns`` and a sealed record of chunk b"K"*16 (small layout)."""
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=SMALL.dtype)
    payload = layout.chunk_bytes(CHUNK)
    conn = ValkeyConnection(ValkeySettings(nodes=(("127.0.0.1", server.nodes[0].port),)))
    rec = bytearray(record.record_bytes(payload))
    rec[record.HEADER_BYTES :] = bytes(i % fill for i in range(payload))
    record.seal(memoryview(rec), ns, b"K" * 16, payload)
    return conn, ValkeyTier(conn, payload, ns), rec


def test_tier_reads_into_the_callers_buffer(valkey_server: ValkeyServers) -> None:
    conn, tier, rec = tier_and_record(valkey_server, b"N" * 16, 251)
    try:
        assert tier.write(b"K" * 16, memoryview(rec))
        buf = bytearray(len(rec) + 100)
        assert tier.read_into(b"K" * 16, memoryview(buf))
        assert buf[: len(rec)] == rec
        assert tier.contains_many([b"K" * 16, b"X" * 16]) == [True, False]
        assert tier.delete(b"K" * 16) and not tier.contains(b"K" * 16)
    finally:
        conn.close()


def test_cluster_mode_ignores_a_database_with_a_warning(
    make_store: StoreFactory, valkey_cluster: ValkeyServers, caplog: pytest.LogCaptureFixture
) -> None:
    s = make_store(model_id="db", **remote(valkey_cluster, valkey_database=3))
    assert "valkey_database=3 is ignored in cluster mode" in caplog.text
    assert s.stats()["valkey"]["connected"] == 1


def test_cli_valkey_start_serves_until_terminated(tmp_path: Any) -> None:
    import signal
    import subprocess

    from hpkv.bench.valkey import Resp

    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpkv.cli.main",
            "valkey",
            "start",
            "--port",
            str(port),
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert f"valkey://127.0.0.1:{port}" in line
        assert Resp(port).command("PING") == "PONG"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0


def test_a_tenant_acl_user_reads_its_own_prefix_only(valkey_server: ValkeyServers) -> None:
    """Each tenant's chunks live under ``hpkv:<tag>:``; an ACL user granted that pattern reads them
    and is refused another tenant's (a refused GET is a miss, not an error that reaches the engine)."""
    from hpkv.core.keys import tenant_tag

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=SMALL.dtype)
    payload = layout.chunk_bytes(CHUNK)
    t1, t2 = tenant_tag("", "tenant-1"), tenant_tag("", "tenant-2")
    ns = b"N" * 16
    port = valkey_server.nodes[0].port
    adm = valkey_server.admin()
    adm.command(
        "ACL",
        "SETUSER",
        "tenant1",
        "on",
        ">pw1",
        f"~hpkv:{t1}:*",
        "+@connection",
        "+info",
        "+get",
        "+set",
        "+exists",
    )
    engine = ValkeyConnection(ValkeySettings(nodes=(("127.0.0.1", port),)))
    mine = ValkeyConnection(ValkeySettings(nodes=(("127.0.0.1", port),), username="tenant1", password="pw1"))
    try:
        tier = ValkeyTier(engine, payload, ns)
        rec = bytearray(record.record_bytes(payload))
        rec[record.HEADER_BYTES :] = bytes(i % 253 for i in range(payload))
        record.seal(memoryview(rec), ns, b"K" * 16, payload)
        assert tier.write(b"K" * 16, memoryview(rec), t1) and tier.write(b"K" * 16, memoryview(rec), t2)
        assert tier.key_name(b"K" * 16, t1).startswith(f"hpkv:{t1}:".encode())
        restricted = ValkeyTier(mine, payload, ns)
        buf = bytearray(len(rec))
        assert restricted.read_into(b"K" * 16, memoryview(buf), tenant=t1) and buf == rec
        assert not restricted.read_into(b"K" * 16, memoryview(bytearray(len(rec))), tenant=t2)
        assert not restricted.read_into(b"K" * 16, memoryview(bytearray(len(rec))))  # the shared prefix
        # The server itself refuses: the ACL, not hpkv, keeps the tenants apart.
        import redis

        r = redis.Redis(port=port, username="tenant1", password="pw1")
        assert r.get(tier.key_name(b"K" * 16, t1)) == bytes(rec)
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.get(tier.key_name(b"K" * 16, t2))
        r.close()
    finally:
        mine.close()
        engine.close()
        adm.command("ACL", "DELUSER", "tenant1")


def test_a_write_replaces_a_bad_value_and_reads_nothing(valkey_server: ValkeyServers) -> None:
    """A corrupt value under a chunk's key is a miss, and the next write of that chunk replaces it
    (a write that checked EXISTS first kept it forever); writes never count as keyspace hits, so
    the L2 proof (one hit per chunk read) is not inflated by stores."""
    conn, tier, rec = tier_and_record(valkey_server, b"W" * 16, 249)
    try:
        bad = bytearray(rec)
        bad[-1] ^= 0xFF
        valkey_server.admin().command("SET", tier.key_name(b"K" * 16), bytes(bad))
        buf = bytearray(len(rec))
        assert not tier.read_into(b"K" * 16, memoryview(buf))
        assert tier.stats()["corrupt"] == 1
        hits = valkey_server.keyspace_hits()
        assert tier.write(b"K" * 16, memoryview(rec))
        assert tier.write(b"K" * 16, memoryview(rec))  # known now: not sent again
        assert valkey_server.keyspace_hits() == hits
        assert tier.stats()["writes"] == 1
        assert tier.read_into(b"K" * 16, memoryview(buf)) and buf == rec
    finally:
        conn.close()


def test_put_never_waits_on_a_slow_valkey(make_store: StoreFactory, valkey_server: ValkeyServers) -> None:
    """Each reply 0.3 s late: put() of 16 chunks took 6 s (an EXISTS per chunk from the caller's
    thread); now the caller only fills memory and the cascade writes in the background."""
    # A real valkey-server behind a far link (a slow server cannot be had on demand).
    proxy = ThrottledProxy(("127.0.0.1", valkey_server.nodes[0].port), reply_delay=0.3).start()
    try:
        s = make_store(
            model_id="slow",
            storage_path=None,
            remote_url=f"valkey://127.0.0.1:{proxy.port}",
            request_timeout=5.0,
            connection_timeout=10.0,
        )
        toks = random_tokens(16 * CHUNK, seed=31)
        kv = random_kv(SMALL, len(toks), seed=31)
        t0 = time.monotonic()
        assert s.put(toks, kv) == 16 * CHUNK
        assert time.monotonic() - t0 < 1.0, "put() waited on the remote server"
        s.flush()
        assert s.stats()["valkey"]["writes"] == 16
        hits = valkey_server.keyspace_hits()
        t0 = time.monotonic()
        assert s.put(toks, kv) == 16 * CHUNK  # held already: no round trip at all
        assert time.monotonic() - t0 < 1.0
        s.flush()
        assert valkey_server.keyspace_hits() == hits and s.stats()["valkey"]["writes"] == 16
    finally:
        proxy.close()


def test_a_forged_record_on_valkey_is_served_only_without_an_auth_key(
    make_store: StoreFactory, valkey_server: ValkeyServers
) -> None:
    """Whoever can write the shared server can write a record with a valid xxh3 checksum under a
    chunk's key. Without HPKV_AUTH_KEY that forgery is served (the checksum is for accidents);
    with it, every record carries a keyed MAC and the forgery is a miss."""
    toks = random_tokens(2 * CHUNK, seed=41)
    kv = random_kv(SMALL, len(toks), seed=41)
    forged_kv = random_kv(SMALL, len(toks), seed=42)

    def forge(store: Any) -> None:
        """Overwrite each chunk's value with a plain (checksummed, un-MAC'd) record of other bytes."""
        from hpkv.core import record as rec_mod

        key_auth = rec_mod._auth_key
        rec_mod._auth_key = None  # the forger has no key
        try:
            for i, key in enumerate(store.keys(toks)):
                payload = (
                    forged_kv[:, :, i * CHUNK : (i + 1) * CHUNK].contiguous().view(torch.uint8).flatten()
                )
                buf = bytearray(record.record_bytes(store.payload_bytes))
                buf[record.HEADER_BYTES :] = payload.numpy().tobytes()
                rk = store.record_key(key)
                record.seal(memoryview(buf), store.namespace.digest, rk, store.payload_bytes)
                valkey_server.admin().command("SET", store.valkey.key_name(rk), bytes(buf))
        finally:
            rec_mod._auth_key = key_auth

    plain = make_store(model_id="forge", **remote(valkey_server))
    plain.put(toks, kv)
    plain.flush()
    forge(plain)
    assert bits_equal(plain.get(toks), forged_kv)  # served: why a shared tier needs the key
    plain.close()
    record.set_auth_key(None)

    secret = "s3cret-shared-by-our-engines-only"
    a = make_store(model_id="forge-mac", **remote(valkey_server, auth_key=secret))
    a.put(toks, kv)
    a.flush()
    assert bits_equal(a.get(toks), kv)
    forge(a)
    assert a.lookup(toks) == 2 * CHUNK  # the keys exist on the server ...
    assert a.get(toks).shape[2] == 0  # ... but nothing forged is handed out
    assert a.stats()["valkey"]["corrupt"] >= 1


def test_close_unmaps_the_pool_after_a_remote_read(
    make_store: StoreFactory, valkey_server: ValkeyServers
) -> None:
    """A valkey worker's last job held a slice of the pool until the worker ended; close() stopped
    the workers after unmapping, so 256 MiB stayed mapped until garbage collection."""
    toks = random_tokens(4 * CHUNK, seed=51)
    kv = random_kv(SMALL, len(toks), seed=51)
    a = make_store(model_id="unmap", **remote(valkey_server))
    a.put(toks, kv)
    a.flush()
    b = make_store(model_id="unmap", **remote(valkey_server, mem_pool_size="256M"))
    assert bits_equal(b.get(toks), kv) and b.stats()["valkey"]["hits"] == 4
    assert b.pool is not None
    name = os.path.basename(b.pool.path)
    b.close()
    with open("/proc/self/maps") as f:
        assert name not in f.read()
