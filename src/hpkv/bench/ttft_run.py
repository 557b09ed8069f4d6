"""``hpkv bench ttft``'s runner: one system's server through the scenarios, each row proven by the
counters (see :mod:`hpkv.bench.ttft` for the protocol), and the interleaved run of several systems."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hpkv.bench.prompts import in_turn
from hpkv.bench.refs import drop_page_cache, raw_glide_gbps, raw_read_gbps
from hpkv.bench.server import Server, ServerError, bench_env, first_error, stopped
from hpkv.bench.verify import HITS, Expect, Row, System, hpkv_deltas, verify_engine, verify_hpkv
from hpkv.core.config import HpkvConfig

CHUNK = 256


def model_dtype(model: str) -> str:
    """The dtype the model was saved in: vLLM's "auto" would downcast float32 to bfloat16 on CPU,
    which an AVX2-only CPU computes slowly."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")
    except (OSError, ValueError):
        return "auto"


class Measured:
    """One system's row in the making: the counters before its first request, each request's TTFT,
    and at the end the row, checked against the tier scenario ``name`` claims (hpkv's counters,
    or vLLM's for a peer)."""

    def __init__(
        self,
        server: Server,
        name: str,
        expect: Expect,
        log: list[dict[str, Any]],
        *,
        hpkv: bool = True,
        keyspace: Callable[[], int] | None = None,
        system: str = "",
    ) -> None:
        self.server, self.name, self.expect, self.log = server, name, expect, log
        self.hpkv, self.keyspace, self.system = hpkv, keyspace, system
        self.before = server.settled_stats() if hpkv else {}
        self.engine0 = server.engine_counters()
        self.hits0 = keyspace() if keyspace else 0
        self.log0 = server.log_size()
        self.ttfts: list[float] = []

    def send(self, prompt: str, progress: Any = None) -> float:
        t, resp = self.server.complete(prompt, max_tokens=1)
        self.ttfts.append(t)
        entry = {
            "scenario": self.name,
            "prompt": len(self.ttfts) - 1,
            "ttft_s": t,
            "prompt_tokens": resp.get("usage", {}).get("prompt_tokens"),
        }
        if self.system:
            entry["system"] = self.system
        self.log.append(entry)
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"{self.name} {t:.3f}s")
        else:
            print(
                f"  {self.system + ' ' if self.system else ''}{self.name:8} {len(self.ttfts) - 1}: "
                f"TTFT={t:.6f}s | prompt_tokens={entry['prompt_tokens']}",
                flush=True,
            )
        return t

    def row(self, where: str = "") -> Row:
        # hpkv's counters once nothing is pending (vLLM's own /metrics are updated with each step).
        server, name, expect = self.server, self.name, self.expect
        after = server.settled_stats() if self.hpkv else {}
        engine1 = server.engine_counters()
        d = {
            k: engine1.get(k, 0) - self.engine0.get(k, 0)
            for k in ("prefix_cache_hits", "external_prefix_cache_hits")
        }
        if self.keyspace:
            d["keyspace_hits"] = self.keyspace() - self.hits0
        if self.hpkv:
            d.update(hpkv_deltas(self.before, after))
            # Storage and valkey count each rank's shard: the engine says how many ranks it has.
            ok, proof = verify_hpkv(name, d, replace(expect, ranks=int(after.get("ranks", 1))))
        else:
            ok, proof = verify_engine(name, d, expect, where)
        # The copies' own rate, per load (a hit's loads only: the GPU-hit row's partial blocks are not one).
        copies = server.load_rates(self.log0, expect.tokens // 2) if self.hpkv and name in HITS else []
        return Row(name, self.ttfts, ok, proof if ok else f"INVALID: {proof}", d, copies)


def run_scenario(
    server: Server,
    name: str,
    prompts: list[str],
    pause: float,
    expect: Expect,
    log: list[dict[str, Any]],
    *,
    hpkv: bool = True,
    keyspace: Callable[[], int] | None = None,
    progress: Any = None,
    where: str = "",
) -> Row:
    """Send ``prompts`` and check the counters against the tier ``name`` claims: hpkv's own
    (``hpkv``) or vLLM's (a peer). ``keyspace``: the valkey servers' summed keyspace_hits."""
    m = Measured(server, name, expect, log, hpkv=hpkv, keyspace=keyspace)
    for p in prompts:
        m.send(p, progress)
        time.sleep(pause)
    return m.row(where)


def peer_json(system: str, pool_size: str) -> str | None:
    """The ``--kv-transfer-config`` of a peer without its own server: vLLM's native
    OffloadingConnector gets the same CPU capacity as hpkv's memory pool (``--pool-size``)."""
    from hpkv.core.units import parse_size

    if system == "none":
        return ""
    if system == "native":
        return json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": parse_size(pool_size)},
            }
        )
    return None


NEEDS_LOCAL = {
    "storage": "needs an engine restart",
    "storage-cold": "needs the storage files on this machine",
    "valkey": "needs an engine restart",
}
VARIANTS = ("hpkv-layerwise", "hpkv-async", "hpkv-sync", "hpkv-engine")
SYSTEMS = ("hpkv", *VARIANTS, "none", "native", "lmcache")
# hpkv-layerwise: hpkv with HPKV_LAYERWISE_LOAD=true (on CUDA each layer is loaded, then attended to);
# hpkv-engine: HPKV_MEMORY_POOL=engine (a memory pool of the engine's own, not the host's);
# hpkv-async: HPKV_ASYNC_LOAD=true (vLLM's async load: each chunk sent to the engine as it reaches memory);
# hpkv-sync: HPKV_ASYNC_LOAD=false (every hit loaded inside the step that admits it);
VARIANT_ENV = {
    "hpkv-layerwise": {"HPKV_LAYERWISE_LOAD": "true"},
    "hpkv-async": {"HPKV_ASYNC_LOAD": "true"},
    "hpkv-sync": {"HPKV_ASYNC_LOAD": "false"},
    "hpkv-engine": {"HPKV_MEMORY_POOL": "engine"},  # each engine its own memory pool
}


SHARED_ROWS = ("prefill", "gpu", "memory")  # the rows --interleave alternates across the systems


def interleaved(runners: list[Runner], scenarios: list[str]) -> list[System]:
    """Every system's server at once; the prefill, GPU-hit and memory rows request by request, the
    systems' order turned at each prompt (so none always goes first), each request sent once every
    server is quiet (vLLM's workers poll for a while after a step); then each system's other rows
    (its restarts included) while the others' servers idle."""
    plans = {id(r): r.plan(scenarios) for r in runners}
    try:
        live = [r for r in runners if r.start(plans[id(r)])]
        for name in [s for s in SHARED_ROWS if s in scenarios]:
            taking = [r for r in live if name in plans[id(r)]]
            rows = {id(r): r.begin(name) for r in taking}
            for i, p in enumerate(taking[0].prompts if taking else []):
                for r in in_turn(taking, i):
                    for other in taking:
                        assert other.server is not None
                        other.server.quiet()
                    rows[id(r)][0].send(p)
                    time.sleep(r.args.pause)
            for r in taking:
                r.end(rows[id(r)])
        for r in live:
            r.run([s for s in plans[id(r)] if s not in SHARED_ROWS], started=True)
    except (ServerError, RuntimeError, OSError) as e:
        stopped([r.out for r in runners], e)
    finally:
        for r in runners:
            r.close()
    return [r.out for r in runners]


class Runner:
    """One system's run on one engine: start, the scenarios in order with what each needs before it
    (a reset, a restart, emptied tiers), the references, stop."""

    def __init__(
        self,
        args: argparse.Namespace,
        system: str,
        model: str | None,
        prompts: list[str],
        expect: Expect,
        log: list[dict[str, Any]],
        *,
        port: int | None = None,
    ) -> None:
        self.args, self.system, self.model, self.prompts, self.expect, self.log = (
            args, system, model, prompts, expect, log,
        )  # fmt: skip
        self._port = port  # None: --port
        self.hpkv = system.startswith("hpkv")  # hpkv or a variant of it (its own settings, same proofs)
        self.out = System(system)
        self.work = tempfile.mkdtemp(prefix="hpkv-bench-ttft-")
        self.shm = tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm")
        self.valkey: Any = None
        self.link: Any = None  # the throttled proxy in front of the embedded valkey (--valkey-link-mbs)
        self.server: Server | None = None
        self.lmcache: Any = None
        self.peer_python = sys.executable
        self.storage = True  # hpkv gets a storage tier (the serve bench's --tiers can leave it out)

    # -- the plan ---------------------------------------------------------------------------

    def plan(self, scenarios: list[str]) -> list[str]:
        todo = list(scenarios)
        # vLLM alone has no tier below its own cache; native has one, CPU memory (proven by vLLM's
        # connector counters, as LMCache's rows are).
        own = {"none": (), "native": ("memory",)}.get(self.system)
        if own is not None:
            for s in [s for s in todo if s in HITS and s not in own]:
                self.out.skipped.append((s, f"no such KV connector tier in a '{self.system}' run"))
            todo = [s for s in todo if s not in HITS or s in own]
        if self.args.url is not None:
            for s in [s for s in todo if s in NEEDS_LOCAL or (s in HITS and not self.hpkv)]:
                self.out.skipped.append((s, f"{NEEDS_LOCAL.get(s, 'needs a restart')} (run with --model)"))
            todo = [s for s in todo if s not in NEEDS_LOCAL and (s not in HITS or self.hpkv)]
        return todo

    @property
    def port(self) -> int:
        return int(self.args.port if self._port is None else self._port)

    def run(self, scenarios: list[str], *, started: bool = False) -> System:
        """The scenarios in order (``started``: on the server :meth:`start` already started, left
        running for the caller to close)."""
        todo = self.plan(scenarios) if not started else list(scenarios)
        try:
            if not started and not self.start(todo):
                return self.out
            from tqdm import tqdm

            with tqdm(
                total=len(todo) * len(self.prompts), desc=self.system, unit="req", file=sys.stdout
            ) as bar:
                for name in todo:
                    measured = self.begin(name, bar)
                    bar.set_description(f"{self.system}: {name}")
                    for p in self.prompts:
                        measured[0].send(p, bar)
                        time.sleep(self.args.pause)
                    self.end(measured)
        except (ServerError, RuntimeError, OSError) as e:
            self.out.error = self.out.error or first_error(str(e))
            print(f"[{self.system}] stopped: {self.out.error}", flush=True)
        finally:
            if not started:
                self.close()
        return self.out

    def begin(self, name: str, bar: Any = None) -> tuple[Measured, str]:
        """Bring the tiers into the state scenario ``name`` needs and start measuring its row;
        returns the row in the making and, for a peer, where its data must be coming from."""
        expect, where = self._prepare(name, bar)
        assert self.server is not None
        keyspace = self.valkey.keyspace_hits if self.valkey and name == "valkey" else None
        m = Measured(
            self.server, name, expect, self.log, hpkv=self.hpkv, keyspace=keyspace, system=self.system
        )
        return m, where

    def end(self, measured: tuple[Measured, str]) -> None:
        """The row's proof from the counters, and the raw reference of the tier it proved."""
        m, where = measured
        row = m.row(where)
        self.out.rows.append(row)
        if self.hpkv and row.valid:
            self._reference(m.name)

    # -- engines and servers ------------------------------------------------------------------

    def start(self, todo: list[str]) -> bool:
        args = self.args
        if args.url is not None:
            u = urllib.parse.urlparse(args.url)
            self.server = Server(args.model or "", u.port or 80, {}, os.devnull)
            served = self.server.request("GET", "/v1/models")[1]
            self.server.model = json.loads(served)["data"][0]["id"]
            return True
        assert self.model is not None
        env = bench_env()
        env.update(
            {
                "HPKV_KV_MEM_POOL_SIZE": args.pool_size,
                "HPKV_SHARE_MEM_FILE_PATH": self.shm,
                "HPKV_KV_STORAGE_PATH": self._storage_dir() if self.storage else "",
                "VLLM_SERVER_DEV_MODE": "1",
            }
        )
        env.update(VARIANT_ENV.get(self.system, {}))
        wants_valkey = "valkey" in todo and (self.hpkv or self.system == "lmcache")
        if self.hpkv and args.remote_url:
            env["HPKV_REMOTE_URL"] = args.remote_url
        elif wants_valkey:
            from hpkv.bench.valkey import ValkeyServers

            self.valkey = ValkeyServers(directory=os.path.join(self.work, "valkey")).start()
            if self.hpkv:
                env["HPKV_REMOTE_URL"] = self.valkey.url
                if args.valkey_link_mbs > 0:
                    from hpkv.bench.throttle import ThrottledProxy

                    node = ("127.0.0.1", self.valkey.nodes[0].port)
                    self.link = ThrottledProxy(node, args.valkey_link_mbs * 1e6).start()
                    env["HPKV_REMOTE_URL"] = self.link.url
        # The same thread binding for every run: vLLM-CPU's automatic binding changes the number of
        # compute threads when a connector is configured, which would skew comparisons.
        cpus = sorted(os.sched_getaffinity(0))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
        vllm_args = [
            "--max-model-len", str(max(args.tokens + 64, 2048)),
            "--max-num-batched-tokens", "2048",
            "--dtype", model_dtype(self.model),
        ] + (args.vllm_args.split() if args.vllm_args else [])  # fmt: skip
        connector = peer_json(self.system, args.pool_size)
        if self.system == "lmcache":
            from hpkv.bench.peers import LMCacheServer, lmcache_connector, lmcache_python

            py, why = lmcache_python()
            if py is None:
                self.out.error = why
                print(f"[{self.system}] not run: {why}", flush=True)
                return False
            self.peer_python = py
            port = self.port + 100
            self.lmcache = LMCacheServer(
                py,
                port,
                os.path.join(args.out, "lmcache-server.log"),
                l1_gb=_gib(args.pool_size),
                fs_dir=self._storage_dir(),
                valkey=("127.0.0.1", self.valkey.nodes[0].port) if self.valkey else None,
            )
            connector = lmcache_connector(port)
        self.server = Server(
            self.model,
            self.port,
            env,
            os.path.join(args.out, f"vllm-{self.system}.log"),
            block_size=args.block_size,
            connector_json=connector,
            vllm_args=vllm_args,
            python=self.peer_python,
        )
        print(f"[{self.system}] starting vLLM on {self.model} (log: {self.server.log_path})", flush=True)
        try:
            if self.lmcache is not None:
                self.lmcache.start()
            self.server.start()
        except (ServerError, RuntimeError) as e:
            self.out.error = first_error(str(e) + "\n" + self.server.log_tail(400))
            print(f"[{self.system}] could not start: {self.out.error}", flush=True)
            return False
        return True

    def _storage_dir(self) -> str:
        return os.path.join(self.work, "storage")

    def _restart(
        self, *, empty_storage: bool = False, valkey_only: bool = False, drop_cache: bool = False
    ) -> None:
        """Restart the engine (and LMCache's server: its L1 empties); optionally empty the storage tier
        first or drop its files from the page cache, and give LMCache only its Valkey adapter."""
        assert self.server is not None
        if self.hpkv:  # what the tiers must hold after the restart is written first
            self.server.drained_stats()
        self.server.stop()
        if self.lmcache is not None:
            self.lmcache.stop()
        if empty_storage:
            shutil.rmtree(self._storage_dir(), ignore_errors=True)
        if drop_cache:
            drop_page_cache(self._storage_dir())
        if self.lmcache is not None:
            if valkey_only:
                self.lmcache.fs_dir = None
            self.lmcache.start()
        self.server.start()

    def close(self) -> None:
        """Stop what this run started and remove its directories."""
        self._stop_all()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)

    def _stop_all(self) -> None:
        if self.server is not None and self.args.url is None:
            self.server.stop()
        if self.lmcache is not None:
            self.lmcache.stop()
        if self.link is not None:
            self.link.close()
        if self.valkey is not None:
            self.valkey.stop()

    # -- scenarios ----------------------------------------------------------------------------

    def _prepare(self, name: str, bar: Any) -> tuple[Expect, str]:
        """Bring the tiers into the state scenario ``name`` needs; returns what to expect and, for a
        peer, where the data must be coming from."""
        server, e, lm = self.server, self.expect, self.lmcache is not None
        assert server is not None
        where = ""
        if name == "memory":
            if not self.args.skip_reset:
                server.reset_prefix_cache()
            where = "vLLM's CPU offload pool" if self.system == "native" else "LMCache's L1 (shared memory)"
        elif name == "storage":
            bar.write(f"[{self.system}] restarting (engine cache and memory empty, storage kept)")
            self._restart()
            where = "LMCache restarted: L1 empty, its fs L2 directory kept"
        elif name == "storage-cold":
            bar.write(f"[{self.system}] memory emptied, storage files dropped from the page cache")
            if lm:
                self._restart(drop_cache=True)
            else:
                server.reset_prefix_cache(external=True)
                drop_page_cache(self._storage_dir())
            where = "LMCache restarted, its fs L2 files dropped from the page cache"
        elif name == "mixed":
            bar.write(f"[{self.system}] memory emptied; the first half of each prompt into memory")
            if lm:
                self._restart()
            else:
                server.reset_prefix_cache(external=True)
            e = replace(e, in_memory=e.chunks // 2)
            for p in self.prompts:
                server.complete(_prefix(p, e.in_memory * CHUNK), max_tokens=1)
            time.sleep(0.6)
            server.reset_prefix_cache()
            where = "LMCache: half of each prompt fetched into L1 first, the rest in its fs L2"
        elif name == "valkey":
            bar.write(f"[{self.system}] restarting with memory and storage emptied")
            self._restart(empty_storage=True, valkey_only=True)
            where = "LMCache restarted with only its Valkey (RESP) L2, the fs directory deleted"
        return e, where

    def _reference(self, name: str) -> None:
        """The raw rate of the tier the row just proved, on this run's data."""
        try:
            threads = _io_threads()  # hpkv's storage I/O threads, as the server was started with them
            if name == "storage":
                gbps = raw_read_gbps(self._storage_dir(), self.expect.chunks, threads, cold=False)
                self.out.refs[name] = (
                    f"raw buffered read of {self.expect.chunks} of its files, {threads} threads",
                    gbps,
                )
            elif name == "storage-cold":
                gbps = raw_read_gbps(self._storage_dir(), self.expect.chunks, threads, cold=True)
                self.out.refs[name] = (
                    f"raw O_DIRECT read of {self.expect.chunks} of its files, {threads} threads",
                    gbps,
                )
            elif name == "valkey" and self.valkey is not None:
                workers = HpkvConfig.from_env().valkey_num_workers  # the engine's, as with storage
                via = (("127.0.0.1", self.link.port),) if self.link is not None else None
                gbps = raw_glide_gbps(self.valkey, self.expect.chunks, workers=workers, nodes=via)
                self.out.refs[name] = (
                    f"raw GLIDE GET loop over {self.expect.chunks} of its keys, {workers} threads"
                    + (f", through the same {self.args.valkey_link_mbs:g} MB/s link" if via else ""),
                    gbps,
                )
        except Exception as e:  # a reference that could not be measured is reported, not fatal
            self.out.refs[name] = (f"not measured: {type(e).__name__}: {e}", 0.0)


def _io_threads() -> int:
    """``HPKV_STORAGE_IO_THREADS`` as the engine reads it (the servers get it: bench_env)."""
    return HpkvConfig.from_env().storage_io_threads


def _gib(size: str) -> float:
    from hpkv.core.units import parse_size

    return parse_size(size) / 2**30


def _prefix(prompt: str, tokens: int) -> str:
    """The first ``tokens`` tokens of a prompt of single-token words."""
    return " ".join(prompt.split(" ")[:tokens])
