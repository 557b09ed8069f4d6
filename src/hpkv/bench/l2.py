"""``hpkv bench l2``: the seed's L2 (remote tier) benchmark, proven by the servers' own counters.

    hpkv bench l2 generate --out DIR [--model DIR] [--tokens 8192] [--floods 3]
    hpkv bench l2 run [--prompt-dir DIR] [--model DIR] [--cluster N]            (embedded servers)
    hpkv bench l2 run --prompt-dir DIR --url http://HOST:PORT --valkey-nodes H:P[,H:P...] [--ranks N]

``generate`` writes a test prompt and ``--floods`` flood prompts of random words,
each from its own seed, and checks that no flood shares the test prompt's first
chunk (a shared prefix means shared chunk keys: the flood would refresh the test
prompt's chunks instead of evicting them).

``run`` (the seed's ``benchmark_l2.py`` sequence): restart the engine (memory
pool empty), FLUSHALL every primary, send the test prompt cold, send the floods
so the memory tier no longer holds the test prompt, read ``keyspace_hits`` on
every primary, send the test prompt again, read them again. The lookup asks
valkey once (one pipelined EXISTS per chunk), then reads each chunk with one GET;
both count as keyspace hits, so the delta must equal 2 x chunks x ranks (the seed's
own LMCache figures show the same: 508 for 254 chunks) and hpkv must have verified
chunks x ranks reads; only then does it print
``L2 RETRIEVAL CONFIRMED`` with the cold and L2 TTFT. Otherwise the verdict names
the likely cause. Embedded mode (no ``--url``) starts valkey-server and vLLM with
hpkv (memory + valkey, no storage tier) on the demo model, with a memory pool
sized so the floods must evict the test prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
import urllib.parse
from typing import Any

from hpkv.bench.server import Server, bench_env, counter
from hpkv.bench.valkey import Resp, ValkeyServers, info
from hpkv.core.record import record_bytes
from hpkv.tiers.memory.pool import slot_bytes

CHUNK = 256
TEST_SEED = 42


def _random_text(seed: int, words: list[str] | None, n_words: int) -> str:
    r = random.Random(seed)
    if words:
        return " ".join(r.choice(words) for _ in range(n_words))
    return " ".join(
        "".join(r.choice(string.ascii_lowercase) for _ in range(r.randint(3, 10))) for _ in range(n_words)
    )


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def generate(model: str, out: str, tokens: int, floods: int) -> int:
    os.makedirs(out, exist_ok=True)
    tok = _tokenizer(model)
    words_file = os.path.join(model, "hpkv-words.txt")
    words = None
    if os.path.exists(words_file):  # the demo model's vocabulary: one token per word
        with open(words_file) as fw:
            words = fw.read().split()

    def make(seed: int) -> tuple[str, list[int]]:
        n = tokens
        for _ in range(6):  # random words are not one token each in a real tokenizer: adjust
            text = _random_text(seed, words, n)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) == tokens:
                break
            n = max(1, int(n * tokens / max(len(ids), 1)))
        ids = ids[:tokens]
        return tok.decode(ids), ids

    test_text, test_ids = make(TEST_SEED)
    prompts = {"test": test_text}
    ok = True
    for i in range(floods):
        text, ids = make(1000 + i * 1000)
        overlap = 0
        while overlap < min(len(ids), len(test_ids)) and ids[overlap] == test_ids[overlap]:
            overlap += 1
        verdict = "OK, different chunk keys" if overlap < CHUNK else "WARNING: shares the first chunk"
        ok = ok and overlap < CHUNK
        print(
            f"Flood {i + 1}: {len(ids)} tokens  Token prefix overlap with test: {overlap} "
            f"(chunk_size={CHUNK} -> {verdict})"
        )
        prompts[f"flood_{i + 1}"] = text
    for name, text in prompts.items():
        with open(os.path.join(out, f"{name}.txt"), "w") as f:
            f.write(text)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"model": model, "tokens": tokens, "floods": floods, "test_tokens": len(test_ids)}, f)
    print(f"wrote the test prompt ({len(test_ids)} tokens) and {floods} floods to {out}")
    if not ok:
        print(
            "a flood shares the test prompt's first chunk: choose other seeds or more tokens", file=sys.stderr
        )
    return 0 if ok else 1


def _load_prompts(d: str) -> tuple[str, list[str], dict[str, Any]]:
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    with open(os.path.join(d, "test.txt")) as f:
        test = f.read()
    floods = []
    for i in range(meta["floods"]):
        with open(os.path.join(d, f"flood_{i + 1}.txt")) as f:
            floods.append(f.read())
    return test, floods, meta


class _Primaries:
    """keyspace_hits and FLUSHALL over the primaries given by host:port."""

    def __init__(self, nodes: list[tuple[str, int]]) -> None:
        self.nodes = nodes

    def _each(self, fn: Any) -> list[Any]:
        out = []
        for h, p in self.nodes:
            c = Resp(p, host=h)
            try:
                out.append(fn(c))
            finally:
                c.close()
        return out

    def keyspace_hits(self) -> int:
        return sum(self._each(lambda c: int(info(c, "stats").get("keyspace_hits", 0))))

    def flushall(self) -> None:
        self._each(lambda c: c.command("FLUSHALL"))

    def keys(self) -> int:
        return sum(self._each(lambda c: int(c.command("DBSIZE"))))


def run(args: argparse.Namespace) -> int:
    embedded = args.url is None
    work = tempfile.mkdtemp(prefix="hpkv-bench-l2-")
    servers: ValkeyServers | None = None
    engine: Server | None = None
    shm = ""
    try:
        prompt_dir = args.prompt_dir
        model = args.model
        if embedded:
            if model is None:
                model = os.path.join(args.out, f"demo-model-{args.size}")
                if not os.path.exists(os.path.join(model, "config.json")):
                    from hpkv.bench.demo_model import write_demo_model

                    print(f"writing the demo model ({args.size}) to {model}", flush=True)
                    write_demo_model(model, args.size)
            if prompt_dir is None:
                prompt_dir = os.path.join(args.out, "prompts")
                if generate(model, prompt_dir, args.tokens, args.floods) != 0:
                    return 1
        elif prompt_dir is None:
            print("hpkv bench l2 run: --url needs --prompt-dir (make one with `generate`)", file=sys.stderr)
            return 2
        test, floods, meta = _load_prompts(prompt_dir)
        ranks = args.ranks
        chunks = meta["test_tokens"] // CHUNK

        if embedded:
            assert model is not None
            servers = ValkeyServers(cluster=args.cluster, directory=os.path.join(work, "valkey")).start()
            primaries = _Primaries([("127.0.0.1", n.port) for n in servers.nodes])
            from hpkv.bench.ttft_run import model_dtype

            shm = tempfile.mkdtemp(prefix="hpkv-l2-", dir="/dev/shm")
            per_prompt = kv_bytes_per_token(model) * meta["tokens"]
            # Exactly two prompts' slots: the L2 request is staged whole, and the floods' chunks
            # (more than the pool holds once there are two or more) evict every chunk of the test prompt.
            slot = slot_bytes(record_bytes(kv_bytes_per_token(model) * CHUNK))
            pool = args.pool_size or str(2 * (meta["tokens"] // CHUNK) * slot)
            env = bench_env()
            # The protocol counts one GET per chunk: every remote hit is loaded whole, however the
            # link compares with the prefill (a cost-aware cut would read as a miss).
            env["HPKV_COST_AWARE_LOADS"] = "false"
            env.update(
                {
                    "HPKV_KV_MEM_POOL_SIZE": pool,
                    "HPKV_SHARE_MEM_FILE_PATH": shm,
                    "HPKV_REMOTE_URL": servers.url,
                    "HPKV_VALKEY_MODE": servers.mode,
                    "VLLM_SERVER_DEV_MODE": "1",
                }
            )
            cpus = sorted(os.sched_getaffinity(0))
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
            engine = Server(
                model,
                args.port,
                env,
                os.path.join(args.out, "vllm-l2.log"),
                vllm_args=[
                    "--max-model-len",
                    str(meta["tokens"] + 64),
                    "--max-num-batched-tokens",
                    "2048",
                    "--dtype",
                    model_dtype(model),
                ],
            )
            print(
                f"memory tier {pool} per rank, {len(floods)} floods of {per_prompt / 2**20:.0f} MiB "
                f"of KV each; valkey {servers.url} ({servers.mode})",
                flush=True,
            )
            print("1. starting vLLM with hpkv (memory + valkey)", flush=True)
            engine.start()
        else:
            u = urllib.parse.urlparse(args.url)
            engine = Server(args.served_model or meta["model"], u.port or 80, {}, os.devnull)
            nodes = [(h, int(p)) for h, _, p in (x.rpartition(":") for x in args.valkey_nodes.split(","))]
            primaries = _Primaries(nodes)
            print("1. (--url: the engine is not restarted; resetting its caches instead)", flush=True)
            try:
                engine.reset_prefix_cache(external=True)
            except Exception as e:
                print(f"   could not reset the engine's caches ({e}); restart it before running", flush=True)

        print("2. FLUSHALL on every primary", flush=True)
        primaries.flushall()
        print("3. cold request", flush=True)
        cold, _ = engine.complete(test)
        if embedded:
            _wait_written(engine, chunks * ranks)
        print(f"   cold TTFT {cold:.3f} s; valkey holds {primaries.keys()} keys", flush=True)
        print(f"4. {len(floods)} floods", flush=True)
        for i, f in enumerate(floods):
            t, _ = engine.complete(f)
            print(f"   flood {i + 1}: {t:.3f} s", flush=True)
        if embedded:  # let the floods' writes finish, so their pool slots are free again
            _wait_written(engine, (1 + len(floods)) * chunks * ranks)
        engine.reset_prefix_cache()  # the engine's own prefix cache must not serve the test prompt
        st0 = engine.settled_stats() if embedded else {}
        before = primaries.keyspace_hits()
        print("5. the test prompt again", flush=True)
        l2, _ = engine.complete(test)
        # Counters that include every count of that request: written after it, nothing pending.
        st1 = engine.settled_stats() if embedded else {}
        delta = primaries.keyspace_hits() - before
        expect = 2 * chunks * ranks  # per chunk and rank: the lookup's EXISTS, then the GET
        print()
        print(
            f"keyspace_hits delta: {delta} (expected {expect} = {chunks} chunks x {ranks} ranks, "
            "1 EXISTS + 1 GET each)"
        )
        if embedded:
            hits = counter(st1, "valkey", "hits") - counter(st0, "valkey", "hits")
            mem = counter(st1, "memory", "hits") - counter(st0, "memory", "hits")
            print(f"hpkv counters: valkey hits {hits}, memory-pool hits {mem}")
        result = {
            "cold_ttft": cold,
            "l2_ttft": l2,
            "keyspace_hits_delta": delta,
            "expected": expect,
            "chunks": chunks,
            "ranks": ranks,
        }
        reads = chunks * ranks  # the GETs among those hits: chunk reads hpkv verified
        hpkv_hits = counter(st1, "valkey", "hits") - counter(st0, "valkey", "hits") if embedded else reads
        if delta == expect and hpkv_hits == reads:
            print(
                f"✓ L2 RETRIEVAL CONFIRMED  cold TTFT {cold * 1000:.0f} ms  L2 TTFT {l2 * 1000:.0f} ms  "
                f"speedup {cold / l2:.2f}x"
            )
            ok = True
        else:
            print("✗ L2 RETRIEVAL NOT DETECTED")
            if delta == expect:
                print(
                    f"  - the servers counted {delta} hits but hpkv verified {hpkv_hits} of {reads} chunks "
                    "from valkey: some chunks failed verification"
                )
            for cause in _causes(delta, expect) if delta != expect else []:
                print(f"  - {cause}")
            ok = False
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "l2.json"), "w") as fh:
            json.dump(result | {"confirmed": ok}, fh, indent=1)
        return 0 if ok else 1
    finally:
        if engine is not None and embedded:
            engine.stop()
        if servers is not None:
            servers.stop()
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def kv_bytes_per_token(model: str) -> int:
    """KV bytes per token of a Hugging Face model directory (all layers, K and V, its saved dtype)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    size = 4 if "32" in dtype else 2
    return 2 * int(cfg["num_hidden_layers"]) * int(heads) * int(head_dim) * size


def _wait_written(engine: Server, n: int, timeout: float = 60.0) -> None:
    """The cold request's chunks reach valkey in the background: wait for them before flooding."""
    deadline = time.monotonic() + timeout
    while counter(engine.hpkv_stats(), "valkey", "writes") < n and time.monotonic() < deadline:
        time.sleep(0.1)


def _causes(delta: int, expect: int) -> list[str]:
    if delta == 0:
        return [
            "the memory tier still held the test prompt: HPKV_KV_MEM_POOL_SIZE too large for the floods, "
            "or too few floods (use more --floods or a smaller pool)",
            "a flood shared the test prompt's prefix (re-run `generate` and read its overlap check)",
            "another tier served it (a storage tier: unset HPKV_KV_STORAGE_PATH for this benchmark), "
            "or the engine's own prefix cache",
        ]
    if delta < expect:
        return [
            "only part of the prompt came from valkey: some chunks were still in memory, or were never "
            "written (cascade queue full: see writes_skipped in `hpkv stats`) or were evicted by the server "
            "(maxmemory)",
            "the memory tier could not hold the whole prompt while other writes were in flight (every "
            "remote hit is staged through it): raise HPKV_KV_MEM_POOL_SIZE",
        ]
    return [
        "more hits than one EXISTS and one GET per chunk: another client used these servers during the "
        "run, or --ranks is wrong",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench l2", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="action", required=True)
    g = sub.add_parser("generate", help="write the test prompt and the floods")
    g.add_argument("--out", required=True)
    g.add_argument("--model", required=True, help="model directory (for its tokenizer)")
    g.add_argument("--tokens", type=int, default=8192)
    g.add_argument("--floods", type=int, default=3)
    r = sub.add_parser("run", help="cold, floods, L2 request, verdict")
    r.add_argument("--prompt-dir", default=None)
    r.add_argument("--model", default=None, help="model directory (default: the demo model)")
    r.add_argument("--size", default="small", choices=["tiny", "small"])
    r.add_argument("--tokens", type=int, default=8192)
    r.add_argument("--floods", type=int, default=3)
    r.add_argument("--cluster", type=int, default=0, help="embedded: a cluster of N primaries")
    r.add_argument("--pool-size", default=None, help="embedded: HPKV_KV_MEM_POOL_SIZE (default 2 prompts)")
    r.add_argument("--port", type=int, default=8331)
    r.add_argument("--url", default=None, help="a running engine, e.g. http://127.0.0.1:8000")
    r.add_argument("--served-model", default=None)
    r.add_argument("--valkey-nodes", default="127.0.0.1:6379", help="every primary, host:port,...")
    r.add_argument("--ranks", type=int, default=1, help="tensor-parallel size of the engine")
    r.add_argument("--out", default="out/bench-l2")
    a = ap.parse_args(argv)
    if a.action == "generate":
        return generate(a.model, a.out, a.tokens, a.floods)
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
