"""``hpkv``: serve, pool, demo-model, stats, clear, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from hpkv.bench.demo_archs import ARCHS
from hpkv.bench.demo_model import QWEN2, SIZES

if TYPE_CHECKING:
    from hpkv.core.config import HpkvConfig


def main(argv: list[str] | None = None) -> int:
    from hpkv.core.errors import HpkvConfigError

    try:
        return _main(argv)
    except HpkvConfigError as e:
        print(f"hpkv: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, vllm_args = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(prog="hpkv", description="hpkv: a hierarchical KV cache for LLM serving")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="start vLLM's OpenAI server with hpkv (args after -- go to vLLM)")
    s.add_argument("model")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--block-size", type=int, default=64)
    s.add_argument("--kv-role", choices=["kv_both", "kv_producer", "kv_consumer"], default="kv_both")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-model-len", type=int, default=None)

    d = sub.add_parser("demo-model", help="write a random-weight model and tokenizer (offline)")
    d.add_argument("dir")
    d.add_argument("--size", choices=list(SIZES), default="small", help="the Qwen2 model's shape")
    d.add_argument(
        "--arch",
        choices=[QWEN2, *ARCHS],
        default=QWEN2,
        help="model family: qwen2 (dense, full attention) or a small model of another family",
    )
    d.add_argument(
        "--config-only",
        action="store_true",
        help="config and tokenizer, no weights: for an engine's random weights (--load-format dummy)",
    )

    st = sub.add_parser("stats", help="per-tier counters of running engines")
    st.add_argument("--dir", default=None, help="pool directory (default: HPKV_SHARE_MEM_FILE_PATH)")
    st.add_argument("--json", action="store_true")

    c = sub.add_parser("clear", help="delete every chunk in a storage directory")
    c.add_argument("--storage", default=None, help="storage directory (default: HPKV_KV_STORAGE_PATH)")

    b = sub.add_parser(
        "bench", help="benchmarks: ttft (the seed's table), serve (under load), cold, l2, valkey"
    )
    b.add_argument("which", choices=["ttft", "serve", "cold", "l2", "valkey"])
    b.add_argument("rest", nargs=argparse.REMAINDER)

    v = sub.add_parser("valkey", help="run real valkey-server processes on loopback (for trying hpkv)")
    v.add_argument("action", choices=["start"])
    v.add_argument(
        "--cluster", type=int, default=0, help="N primaries with the slots split (default: standalone)"
    )
    v.add_argument("--port", type=int, default=None, help="first port (default: a free one)")
    v.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    v.add_argument("--maxmemory", default=None, help="per server, e.g. 4gb (with volatile-lru eviction)")

    tp = sub.add_parser(
        "tenant-prefix", help="the Valkey key prefix of a cache_salt tenant (for an ACL key pattern)"
    )
    tp.add_argument("cache_salt", nargs="?", default="", help="the requests' cache_salt (none: shared)")
    tp.add_argument("--salt", default=None, help="the engine's HPKV_SALT (default: from the environment)")

    pl = sub.add_parser("pool", help="the host's shared memory pool: serve, status, stop")
    pl.add_argument("action", choices=["serve", "status", "stop"])
    pl.add_argument("--dir", default=None, help="pool directory (default: HPKV_SHARE_MEM_FILE_PATH)")
    pl.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="serve: seconds without engines before it stops, 0: never (default: HPKV_POOL_IDLE_TIMEOUT)",
    )

    dl = sub.add_parser("demo-lora", help="write a random LoRA adapter (PEFT format) for a demo model")
    dl.add_argument("model")
    dl.add_argument("dir")
    dl.add_argument("--seed", type=int, default=1)

    a = ap.parse_args(argv)
    a.vllm_args = vllm_args
    if a.cmd == "tenant-prefix":
        from hpkv.core.keys import tenant_tag

        salt = a.salt if a.salt is not None else _config().salt
        tag = tenant_tag(salt, a.cache_salt)
        print(f"hpkv:{tag}:")
        print(
            f"# e.g. ACL SETUSER <user> on ><password> ~hpkv:{tag}:* +@connection +info +get +set +exists",
            file=sys.stderr,
        )
        return 0
    if a.cmd == "demo-lora":
        from hpkv.bench.demo_model import write_demo_lora

        print(f"wrote a random LoRA adapter (k_proj, v_proj) to {write_demo_lora(a.dir, a.model, a.seed)}")
        return 0
    if a.cmd == "serve":
        from hpkv.cli.serve import main as serve_main

        return serve_main(a)
    if a.cmd == "demo-model":
        from hpkv.bench.demo_model import write_demo_model

        m = write_demo_model(a.dir, a.size, weights=not a.config_only, arch=a.arch)
        model = f"Qwen2 ({a.size})" if a.arch == QWEN2 else ARCHS[a.arch].model
        what = f"a {model} config" if a.config_only else f"a random-weight {model}"
        print(f"wrote {what} and a tokenizer to {m.path}")
        return 0
    if a.cmd == "stats":
        return _stats(a.dir, a.json)
    if a.cmd == "pool":
        return _pool(a.action, a.dir, a.idle_timeout)
    if a.cmd == "clear":
        return _clear(a.storage)
    if a.cmd == "valkey":
        return _valkey_start(a.cluster, a.port, a.dir, a.maxmemory)
    if a.cmd == "bench":
        if a.which == "valkey":
            from hpkv.bench.valkey_tier import main as valkey_main

            return valkey_main(a.rest)
        if a.which == "l2":
            from hpkv.bench.l2 import main as l2_main

            return l2_main(a.rest)
        if a.which == "cold":
            from hpkv.bench.cold import main as cold_main

            return cold_main(a.rest)
        if a.which == "serve":
            from hpkv.bench.serve import main as serve_bench_main

            return serve_bench_main(a.rest)
        rest, engine = _engine(a.rest)
        if engine == "sglang":
            from hpkv.bench.sglang_ttft import main as sglang_ttft_main

            return sglang_ttft_main(rest)
        from hpkv.bench.ttft import main as ttft_main

        return ttft_main(rest)
    return 2  # pragma: no cover


def _config() -> HpkvConfig:
    """The settings as the engines read them (``HPKV_*``, ``HPKV_CONFIG_FILE``); a bad one is an
    error that names it (see :func:`main`)."""
    from hpkv.core.config import HpkvConfig

    return HpkvConfig.from_env()


def _engine(rest: list[str]) -> tuple[list[str], str]:
    """``--engine vllm|sglang`` taken out of ``hpkv bench ttft``'s arguments (default: vllm)."""
    out, engine, i = [], "vllm", 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--engine" and i + 1 < len(rest):
            engine, i = rest[i + 1], i + 2
            continue
        if arg.startswith("--engine="):
            engine = arg.split("=", 1)[1]
        else:
            out.append(arg)
        i += 1
    if engine not in ("vllm", "sglang"):
        raise SystemExit(f"hpkv bench ttft: --engine {engine!r} is not one of vllm, sglang")
    return out, engine


def _pool(action: str, directory: str | None, idle_timeout: float | None) -> int:
    cfg = _config()
    path = os.path.abspath(os.path.expanduser(directory or cfg.share_mem_file_path))
    if action == "serve":
        from hpkv.tiers.memory.hostpool import main as pool_main

        idle = cfg.pool_idle_timeout if idle_timeout is None else idle_timeout
        args = ["--dir", path, "--idle-timeout", str(idle)] + (["--shared-group"] if cfg.shared_group else [])
        return pool_main(args)
    from hpkv.tiers.memory.hostslots import pool_status, stop_pool

    if action == "stop":
        if not stop_pool(path):
            print(f"no hpkv pool serves {path}")
            return 1
        print(f"stopped the hpkv pool of {path}")
        return 0
    st = pool_status(path)
    if st is None:
        print(f"no hpkv pool serves {path}")
        return 1
    print(f"hpkv pool of {st['dir']}: pid {st['pid']}, {len(st['engines'])} engine(s) connected")
    for name, g in st["groups"].items():
        print(
            f"  {name}: {g['ranks']} rank(s) x {g['size'] / 2**30:.2f} GiB, {g['chunks']}/{g['slots']} "
            f"chunks, {g['pinned']} pinned, {g['evictions']} evictions"
        )
    return 0


def _stats(directory: str | None, as_json: bool) -> int:
    from hpkv.integrations.statsfile import read_all

    path = directory or _config().share_mem_file_path
    docs = read_all(path)
    if as_json:
        print(json.dumps(docs, indent=1))
        return 0
    if not docs:
        print(f"no running hpkv engine found under {path}")
        return 1
    for doc in docs:
        print(f"engine pid {doc['pid']}  model {doc['model']}")
        for tier, v in doc.get("tiers", {}).items():
            print(
                f"  {tier:13} hits {v['hits']:>8}  misses {v['misses']:>6}  corrupt {v['corrupt']:>4}  "
                f"read {v['bytes_read'] / 2**20:10.1f} MiB  written {v['bytes_written'] / 2**20:10.1f} MiB  "
                f"used {v['used_bytes'] / 2**20:9.1f}/{v['capacity_bytes'] / 2**20:.0f} MiB  "
                f"evictions {v['evictions']}  errors {v['errors']}"
            )
        print("  connector", " ".join(f"{k}={v}" for k, v in doc.get("connector", {}).items()))
        for part in ("write_behind", "costs"):
            if doc.get(part):
                print(f"  {part}", " ".join(f"{k}={v}" for k, v in doc[part].items()))
    return 0


def _valkey_start(cluster: int, port: int | None, directory: str | None, maxmemory: str | None) -> int:
    import signal
    import threading

    from hpkv.bench.valkey import ValkeyServers

    # Before the servers start and before they are announced: a SIGTERM sent as soon as the URL is
    # printed (a process manager, a test) must stop them, not kill this process and orphan them.
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    servers = ValkeyServers(cluster=cluster, port=port, directory=directory, maxmemory=maxmemory).start()
    kind = f"a cluster of {cluster} primaries" if cluster else "a standalone server"
    print(f"valkey: {kind} on {servers.url}", flush=True)
    print(
        f"  use it: export HPKV_REMOTE_URL={servers.url}" + (" HPKV_VALKEY_MODE=cluster" if cluster else "")
    )
    print("  Ctrl-C stops it (nothing is persisted)", flush=True)
    try:
        while not done.wait(1.0):
            if any(n.proc is None or n.proc.poll() is not None for n in servers.nodes):
                print("valkey: a server exited", file=sys.stderr)
                return 1
    finally:
        servers.stop()
    return 0


def _clear(storage: str | None) -> int:

    from hpkv.tiers.disk.tier import FORMAT_DIR

    path = storage or _config().resolved_storage_path
    if not path:
        print("hpkv clear: give --storage DIR or set HPKV_KV_STORAGE_PATH", file=sys.stderr)
        return 2
    root = os.path.join(os.path.expanduser(path), FORMAT_DIR)
    n = 0
    for d, _, names in os.walk(root):
        for name in names:
            if name.endswith(".kv"):
                os.unlink(os.path.join(d, name))
                n += 1
    print(f"removed {n} chunk files under {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
