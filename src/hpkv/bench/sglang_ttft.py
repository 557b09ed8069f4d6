"""``hpkv bench ttft --engine sglang``: the seed's TTFT table on an SGLang server, each row proven by
SGLang's own report of where the cached prefix came from and, for hpkv, by hpkv's counters.

    hpkv bench ttft --engine sglang [--model DIR | --size 7b] [--tokens 8192] [--prompts 4]
                    [--compare none,hpkv,file] [--scenarios ...] [--interleave] [--profile] [--out DIR]

Every system is SGLang with HiCache (device KV, then its host pool) and the same flags; they differ
in L3: ``none`` (no L3), ``file`` (SGLang's own file backend) and ``hpkv`` (hpkv's storage and Valkey
tiers through SGLang's ``dynamic`` loader; hpkv's memory tier stays off, SGLang's host pool is the
memory tier). The device pool holds one and a half prompts (``--max-total-tokens``), so the host pool,
not the device, serves a prompt sent again later. Rows, in order, on one server per system:

    prefill       each prompt cold
    gpu           the same prompt at once again: the device radix cache
    host          every prompt again, oldest first: evicted from the device, in SGLang's host pool
    storage       after a restart (device and host empty): L3, its files in the OS page cache
    storage-cold  POST /flush_cache and L3's files dropped from the page cache: the device itself
    mixed         POST /flush_cache, L3's files read into the page cache, the first half of each
                  prompt sent first: that half from device or host, the rest from L3
    valkey        (hpkv) after a restart with the storage directory emptied: the Valkey tier

A row counts only if SGLang's ``cached_tokens_details`` puts the prefix in the claimed tier for
every request (and, for hpkv, its tier counters show one read per page); otherwise it is INVALID
with the reason. Load rate = L3 bytes per prompt / (median TTFT - median GPU-hit TTFT), set against
references measured in this run on the same data: a raw read of the system's own page files (warm, and
O_DIRECT after dropping them) and a raw GLIDE GET loop over its Valkey keys. For hpkv, the rate of its
own reads is printed too (pages read x page bytes / the time SGLang's ``batch_get_v1`` calls took):
the same references, without SGLang's prefetch machinery around them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from hpkv.bench.profile import Recorder, describe, summarize
from hpkv.bench.prompts import in_turn, random_prompts
from hpkv.bench.refs import drop_page_cache, raw_glide_gbps, raw_read_gbps, warm_page_cache
from hpkv.bench.server import ServerError, bench_env, counter, first_error, stopped
from hpkv.bench.sglang_report import L3_TIERS, SCENARIOS, Result, Row, report, write_json
from hpkv.bench.sglang_server import BACKENDS, Reply, SGLangServer
from hpkv.core.config import HpkvConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench ttft --engine sglang",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engine", choices=["sglang"], default="sglang")
    ap.add_argument("--model", default=None, help="model directory (default: the demo model's config)")
    ap.add_argument("--size", default="7b", help="demo model size when --model is not given")
    ap.add_argument("--load-format", default="dummy", help="SGLang's --load-format ('auto': saved weights)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--compare", default="none,hpkv,file", help=f"systems, from {', '.join(BACKENDS)}")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--hicache-gb", type=int, default=8, help="SGLang's host pool (--hicache-size)")
    ap.add_argument("--device-prompts", type=float, default=1.5, help="device KV capacity, in prompts")
    ap.add_argument("--port", type=int, default=30200)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between requests")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="run every system's server at once (ports --port, --port+1, ...) and alternate them request "
        "by request in the prefill, GPU-hit and host rows; then each system's L3 rows in turn",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="sample the L3 systems' scheduler processes with py-spy during their L3 rows and print, per "
        "thread group, the busiest lines in milliseconds per page (raw samples: OUT/pyspy-SYSTEM-ROW.txt)",
    )
    ap.add_argument("--out", default="out/bench-ttft-sglang")
    args = ap.parse_args(argv)
    if args.profile and Recorder.available() is None:
        ap.error("--profile needs py-spy on PATH (scripts/sglang-gpu/install.sh installs it on the device)")
    scenarios = [s for s in args.scenarios.split(",") if s]
    systems = [s for s in args.compare.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    for x in systems:
        if x not in BACKENDS:
            ap.error(f"unknown system {x!r}; choose from {', '.join(BACKENDS)}")
    least = args.device_prompts + 1.5
    if "host" in scenarios and args.prompts < least:
        ap.error(f"the host row needs more prompts than the device holds: --prompts >= {least:g}")
    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if model is None:
        from hpkv.bench.demo_model import write_demo_model

        model = os.path.join(args.out, f"demo-model-{args.size}")
        if not os.path.exists(os.path.join(model, "config.json")):
            write_demo_model(model, args.size, weights=args.load_format != "dummy")
    prompts = random_prompts(model, args.prompts, args.tokens)
    log: list[dict[str, Any]] = []
    results: list[Result] = []
    if args.interleave and len(systems) > 1:
        runners = [
            Runner(args, name, model, prompts, log, port=args.port + i) for i, name in enumerate(systems)
        ]
        results = interleaved(args, model, runners, scenarios, log)
    else:
        for name in systems:
            results.append(Runner(args, name, model, prompts, log).run(scenarios))
            write_json(args, model, results, log)  # what is done is kept if a later system runs out of time
    report(args, model, results)
    ours = [x for x in results if x.name == "hpkv"]
    return 0 if all(not x.error and all(r.valid for r in x.rows) for x in ours) else 1


SHARED_ROWS = ("prefill", "gpu", "host")  # the rows --interleave alternates across the systems


def interleaved(
    args: argparse.Namespace,
    model: str,
    runners: list[Runner],
    scenarios: list[str],
    log: list[dict[str, Any]],
) -> list[Result]:
    """Every system's server at once; the prefill, GPU-hit and host rows request by request, the
    systems' order turned at each prompt (so none always goes first); then each system's own rows
    (its restarts included) while the others' servers idle."""
    plans = {id(r): r.plan(scenarios) for r in runners}
    try:
        for r in runners:
            r.start(plans[id(r)])
        shared = [s for s in SHARED_ROWS if s in scenarios]
        for r in runners:
            r.check_shared(shared, plans[id(r)])
        cold: dict[int, list[Reply]] = {id(r): [] for r in runners}
        hot: dict[int, list[Reply]] = {id(r): [] for r in runners}
        host: dict[int, list[Reply]] = {id(r): [] for r in runners}
        if "prefill" in shared:
            for i, p in enumerate(runners[0].prompts):
                for r in in_turn(runners, i):
                    cold[id(r)].append(r.send("prefill", p))
                    if "gpu" in shared:
                        hot[id(r)].append(r.send("gpu", p))
        if "host" in shared:
            for i, p in enumerate(runners[0].prompts):
                for r in in_turn(runners, i):
                    host[id(r)].append(r.send("host", p))
        for r in runners:
            if cold[id(r)]:
                r.out.rows += r.prefill_rows(cold[id(r)], hot[id(r)])
            if host[id(r)]:
                r.out.rows.append(r.host_row(host[id(r)]))
        write_json(args, model, [r.out for r in runners], log)
        for r in runners:
            r.run_rows([s for s in plans[id(r)] if s not in SHARED_ROWS])
            r.close()  # the GPU and host to the systems still to measure
            write_json(args, model, [r.out for r in runners], log)
    except (ServerError, RuntimeError, OSError, AssertionError) as e:
        stopped([r.out for r in runners], e)
    finally:
        for r in runners:
            r.close()
    return [r.out for r in runners]


class Runner:
    """One system: start, the rows in order with what each needs first, the references, stop."""

    def __init__(
        self,
        args: argparse.Namespace,
        system: str,
        model: str,
        prompts: list[str],
        log: list[dict[str, Any]],
        *,
        port: int | None = None,
    ) -> None:
        self.args, self.system, self.model, self.prompts, self.log = args, system, model, prompts, log
        self.port = args.port if port is None else port
        self.out = Result(system)
        self.work = tempfile.mkdtemp(prefix=f"hpkv-sgl-{system}-")
        self.shm = tempfile.mkdtemp(prefix="hpkv-sgl-", dir="/dev/shm")
        self.valkey: Any = None
        self.server: SGLangServer | None = None
        self.warmup = random_prompts(model, 1, 4 * args.page_size, seed=999)[0]
        self.pages = (args.tokens - 1) // args.page_size  # pages a hit can serve (the last token is computed)
        self.served = self.pages * args.page_size

    @property
    def l3_dir(self) -> str:
        return os.path.join(self.work, "l3")

    def plan(self, scenarios: list[str]) -> list[str]:
        own = {"none": ("prefill", "gpu", "host"), "file": SCENARIOS[:-1], "hpkv": SCENARIOS}[self.system]
        for s in scenarios:
            if s not in own:
                self.out.skipped.append((s, f"no such tier with L3 '{self.system}'"))
        return [s for s in scenarios if s in own]

    def run(self, scenarios: list[str]) -> Result:
        todo = self.plan(scenarios)
        try:
            self.start(todo)
            self.run_rows(todo)
        except (ServerError, RuntimeError, OSError, AssertionError) as e:
            self.out.error = first_error(str(e))
            print(f"[{self.system}] stopped: {self.out.error}", flush=True)
        finally:
            self.close()
        return self.out

    def run_rows(self, todo: list[str]) -> None:
        for name in todo:
            if name == "gpu" and "prefill" in todo:
                continue  # measured with prefill: each prompt cold, then at once again
            self.out.rows.extend(self.scenario(name, "gpu" in todo))

    def check_shared(self, shared: list[str], todo: list[str]) -> None:
        missing = [s for s in shared if s not in todo]
        if missing:
            raise RuntimeError(f"--interleave: {self.system} has no row {', '.join(missing)}")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.valkey is not None:
            self.valkey.stop()
            self.valkey = None
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)

    def start(self, todo: list[str]) -> None:
        args = self.args
        os.makedirs(self.l3_dir, mode=0o700)
        env = bench_env()
        env.update(SGLANG_ENABLE_DETERMINISTIC_INFERENCE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if self.system == "hpkv":
            env.update(HPKV_KV_STORAGE_PATH=self.l3_dir, HPKV_SHARE_MEM_FILE_PATH=self.shm)
            if "valkey" in todo:
                from hpkv.bench.valkey import ValkeyServers

                self.valkey = ValkeyServers(directory=os.path.join(self.work, "valkey")).start()
                env["HPKV_REMOTE_URL"] = self.valkey.url
        elif self.system == "file":
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.l3_dir
        self.server = SGLangServer(
            self.model,
            self.port,
            env,
            os.path.join(args.out, f"sglang-{self.system}.log"),
            backend=self.system,
            page_size=args.page_size,
            hicache_gb=args.hicache_gb,
            max_total_tokens=int(args.device_prompts * args.tokens),
            load_format=None if args.load_format == "auto" else args.load_format,
        )
        self._start()

    def _start(self) -> None:
        assert self.server is not None
        print(f"[{self.system}] starting SGLang (log: {self.server.log_path})", flush=True)
        self.out.starts.append(self.server.start())
        print(f"[{self.system}] ready in {self.out.starts[-1]:.0f} s", flush=True)
        # SGLang compiles kernels at a fresh process's first request: not a prefill to measure.
        self.server.generate(self.warmup, max_new_tokens=1)

    def _restart(self, *, empty_storage: bool = False) -> None:
        assert self.server is not None
        self.settle()
        self.server.stop()
        if empty_storage:
            shutil.rmtree(self.l3_dir)
            os.makedirs(self.l3_dir, mode=0o700)
        self._start()

    def settle(self) -> None:
        """Wait until L3 has every page written (SGLang backs up from a thread; hpkv writes behind)."""
        assert self.server is not None
        if self.system == "hpkv":
            self.server.settled_stats(quiet_s=2.0, timeout=120)
            return
        last, since, t0 = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - t0 < 120:
            n = sum(len(fs) for _, _, fs in os.walk(self.l3_dir))
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= 2.0:
                return
            time.sleep(0.25)

    # -- the rows -----------------------------------------------------------------------------

    def scenario(self, name: str, with_gpu: bool) -> list[Row]:
        server, tokens = self.server, self.args.tokens
        assert server is not None
        if name == "prefill":
            cold, hot = [], []
            for p in self.prompts:
                cold.append(self.send("prefill", p))
                if with_gpu:
                    hot.append(self.send("gpu", p))
            return self.prefill_rows(cold, hot)
        if name == "host":
            return [self.host_row([self.send(name, p) for p in self.prompts])]
        if name == "storage":
            self._restart()
        elif name == "storage-cold":
            self.settle()
            server.flush_cache()
            drop_page_cache(self.l3_dir)
        elif name == "mixed":
            server.flush_cache()
            # Its L3 half from the page cache: the cold row's O_DIRECT reads left the files out of it.
            warm_page_cache(self.l3_dir)
            half = (tokens // 2 // self.args.page_size) * self.args.page_size
            for p in self.prompts:
                server.generate(" ".join(p.split(" ")[:half]), max_new_tokens=1)
            time.sleep(self.args.pause)
        elif name == "valkey":
            self._restart(empty_storage=True)
        before = server.settled_stats() if self.system == "hpkv" else {}
        recorder = self.recorder(name)
        replies = [self.send(name, p) for p in self.prompts]
        profiled = self.profile(recorder, sum(r.storage for r in replies) // self.args.page_size)
        after = server.settled_stats() if self.system == "hpkv" else {}
        if name == "mixed":
            least = tokens // 2 - 2 * self.args.page_size
            check = lambda r: r.storage >= least and r.cached >= self.served  # noqa: E731
            claim = f"half from device or host, >= {least} tokens from L3"
        else:
            check = lambda r: r.storage >= self.served  # noqa: E731
            claim = f"{self.served} tokens from L3"
        row = self.row(name, replies, check, claim)
        if row.valid:
            self.reference(name)
        if self.system == "hpkv" and row.valid:
            tier = "valkey" if name == "valkey" else "storage"
            reads = counter(after, tier, "hits") - counter(before, tier, "hits")
            need = sum(r.storage for r in replies) // self.args.page_size
            if reads < need:
                row.valid, row.proof = (
                    False,
                    f"INVALID: hpkv's {tier} served {reads} pages, SGLang took {need}",
                )
            else:
                row.proof += f"; hpkv {tier} hits {reads}"
                if tier == "storage":
                    direct = counter(after, tier, "in_place_reads") - counter(before, tier, "in_place_reads")
                    row.proof += f" ({direct} straight into the host pages)"
            pages = counter(after, "connector", "read") - counter(before, "connector", "read")
            micros = counter(after, "connector", "read_us") - counter(before, "connector", "read_us")
            nbytes = sum(counter(after, t, "bytes_read") - counter(before, t, "bytes_read") for t in L3_TIERS)
            hits = sum(counter(after, t, "hits") - counter(before, t, "hits") for t in L3_TIERS)
            if hits:  # the page size the server really used (a float32 config is served as float16)
                self.out.page_bytes = nbytes // hits
            if micros > 0 and self.out.page_bytes:
                row.backend_gbps = pages * self.out.page_bytes / (micros * 1e-6) / 1e9
        ref = self.out.refs.get(name)
        print(
            f"  [{self.system}] {name}: median TTFT {row.median:.4f} s"
            + (f"; hpkv's reads {row.backend_gbps:.2f} GB/s" if row.backend_gbps else "")
            + (f"; reference {ref[1]:.2f} GB/s ({ref[0]})" if ref else ""),
            flush=True,
        )
        if profiled:
            head = f"  [{self.system}] {name}: its scheduler process's threads (py-spy), ms per L3 page"
            print(f"{head}\n{profiled}", flush=True)
        return [row]

    def recorder(self, name: str) -> Recorder | None:
        """py-spy on the scheduler process for this row (``--profile``), or None; a failure to
        start is printed, not fatal."""
        server = self.server
        if not self.args.profile or server is None:
            return None
        pid = server.process("sglang::scheduler")
        if pid is None:
            print(f"  [{self.system}] {name}: no sglang::scheduler process to profile", flush=True)
            return None
        rec = Recorder(pid, os.path.abspath(os.path.join(self.args.out, f"pyspy-{self.system}-{name}.txt")))
        try:
            rec.start()
        except OSError as e:
            print(f"  [{self.system}] {name}: py-spy did not start: {e}", flush=True)
            return None
        return rec

    def profile(self, rec: Recorder | None, pages: int) -> str:
        if rec is None:
            return ""
        try:
            raw = rec.stop()
        except RuntimeError as e:
            return f"    not profiled: {e}"
        return describe(summarize(raw, rec.rate, pages))

    def prefill_rows(self, cold: list[Reply], hot: list[Reply]) -> list[Row]:
        rows = [self.row("prefill", cold, lambda r: r.cached == 0, "no cached token")]
        if hot:
            rows.append(self.row("gpu", hot, lambda r: r.device >= self.served, "device radix cache"))
        return rows

    def host_row(self, replies: list[Reply]) -> Row:
        half = self.args.tokens // 2
        return self.row(
            "host",
            replies,
            lambda r: r.host >= half and r.storage == 0 and r.cached >= self.served,
            "host pool, nothing from L3",
        )

    def send(self, name: str, prompt: str) -> Reply:
        assert self.server is not None
        r = self.server.generate(prompt, max_new_tokens=1)
        self.log.append(
            {
                "system": self.system,
                "scenario": name,
                "ttft_s": r.ttft,
                "prompt_tokens": r.prompt_tokens,
                "cached": r.cached,
                "device": r.device,
                "host": r.host,
                "storage": r.storage,
            }
        )
        print(
            f"  {self.system:5} {name:12} TTFT={r.ttft:.4f}s cached={r.cached} (device {r.device}, host "
            f"{r.host}, L3 {r.storage}) of {r.prompt_tokens}",
            flush=True,
        )
        time.sleep(self.args.pause)
        return r

    def row(self, name: str, replies: list[Reply], ok: Any, claim: str) -> Row:
        bad = [i for i, r in enumerate(replies) if not ok(r)]
        l3 = int(statistics.median(r.storage for r in replies)) if replies else 0
        ttfts = [r.ttft for r in replies]
        if bad:
            r = replies[bad[0]]
            why = (
                f"INVALID: request {bad[0]} got cached={r.cached} (device {r.device}, host {r.host}, "
                f"L3 {r.storage}); the row claims {claim}"
            )
            return Row(name, ttfts, False, why, l3)
        return Row(name, ttfts, True, f"every request: {claim}", l3)

    def reference(self, name: str) -> None:
        """The raw rate of the tier the row just proved, on this run's files or keys."""
        try:
            if name in ("storage", "storage-cold", "mixed"):  # mixed: its L3 half from the page cache
                threads = HpkvConfig.from_env().storage_io_threads
                cold = name == "storage-cold"
                gbps = raw_read_gbps(self.l3_dir, self.pages, threads, cold=cold)
                how = "O_DIRECT after dropping them" if cold else "buffered, from the page cache"
                self.out.refs[name] = (
                    f"raw read of {self.pages} of its page files, {threads} threads, {how}",
                    gbps,
                )
            elif name == "valkey" and self.valkey is not None:
                workers = HpkvConfig.from_env().valkey_num_workers
                gbps = raw_glide_gbps(self.valkey, self.pages, workers=workers)
                self.out.refs[name] = (
                    f"raw GLIDE GET loop over {self.pages} of its keys, {workers} threads",
                    gbps,
                )
        except Exception as e:  # reported, not fatal
            self.out.refs[name] = (f"not measured: {type(e).__name__}: {e}", 0.0)


if __name__ == "__main__":
    sys.exit(main())
